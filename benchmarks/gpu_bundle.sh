#!/usr/bin/env bash
# Builds .whl/gpu, the offline bundle that benchmarks/gpu_bench.sh reads on an NVIDIA GPU host with no
# network. Run it from the repository root on a machine with pip and PyPI, after `make build` (the
# tokenizer comes from the built model folder):
#   bash benchmarks/gpu_bundle.sh
# What it writes (every version pinned here; Python 3.12, manylinux x86_64 wheels, recompressed with LZMA):
#   tritonserver-min.tar.xz  from the nvidia-pytriton 0.7.0 wheel: the tritonserver 2.51 binary, the Python
#                          backend, the Python 3.12 stub and the nvidia_pytriton.libs they link (found
#                          through their NEEDED entries), stripped, so the bundle travels in one transfer
#   numpy-1.26.4-cp312-*.whl the tritonserver 2.51 stub corrupts BYTES tensors under numpy 2
#   tritonclient-py.zip    tritonclient 2.51.0's Python package (no perf_analyzer) and python-rapidjson
#   tokenizer.tgz          SmolLM2's tokenizer files from build/manifest.json's tokenizer_dir
#   overlay/*.whl          transformers and tokenizers, the project's pins (NO_OVERLAY=1 leaves them out: the
#                          transformers engine refuses any other release at load)
#   serve/*.whl            the OpenAI layer's web stack, jsonschema and tritonclient's HTTP client's gevent, with
#                          their dependencies (for benchmarks/pipeline.py; NO_SERVE=1 leaves them out)
#   tools/*.whl            py-spy, for gpu_bench.sh --profile-dir (NO_PYSPY=1 leaves it out)
# It needs binutils (readelf, strip), xz, unzip, and the project's .venv or another Python with pip
# (PYTHON=...); pip's own cache makes a second run quick.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTRITON=nvidia-pytriton==0.7.0
NUMPY=numpy==1.26.4
TRITONCLIENT=tritonclient==2.51.0
RAPIDJSON=python-rapidjson==1.25
TRANSFORMERS=transformers==5.24.0
TOKENIZERS=tokenizers==0.23.3
PYSPY=py-spy==0.4.2
# requirements.txt's fastapi, uvicorn and jsonschema with their dependencies, as constraints.txt resolves them
SERVE=(fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 click==8.5.1 annotated-doc==0.0.7
  opentelemetry-api==1.45.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1 attrs==26.1.0
  # tritonclient.http (and its aio client) imports gevent; 2.0.12 is the oldest geventhttpclient with a cp312 wheel
  geventhttpclient==2.0.12 gevent==26.9.0 greenlet==3.5.6 zope.event==6.2 zope.interface==8.7 brotli==1.2.1
  certifi==2026.10.19.post1 six==1.17.0)
BUILD_DIR=${BUILD_DIR:-build}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
bundle=.whl/gpu
limit_mib=60

for tool in readelf strip xz unzip; do
  command -v "$tool" >/dev/null || { echo "gpu_bundle: needs $tool (apt-get install binutils xz-utils unzip)" >&2; exit 1; }
done
manifest=$BUILD_DIR/manifest.json
[ -f "$manifest" ] || { echo "gpu_bundle: no $manifest: run make build first (the tokenizer comes from it)" >&2; exit 1; }
tokenizer_dir=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["tokenizer_dir"])' "$manifest")

download() {  # download DEST SPEC...: wheels for CPython 3.12 on manylinux x86_64, no dependencies
  local dest=$1
  shift
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 -d "$dest" "$@"
}

rm -rf "$bundle"
mkdir -p "$bundle"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cache=$work/wheels

echo "gpu_bundle: downloading $PYTRITON $NUMPY $TRITONCLIENT $RAPIDJSON ..."
download "$cache" "$PYTRITON" "$NUMPY" "$TRITONCLIENT" "$RAPIDJSON"

# tritonserver-min.tar.xz: only what the server, the Python backend and the 3.12 stub load.
pytriton_whl=$(ls "$cache"/nvidia_pytriton-0.7.0-*.whl)
tree=$work/pyt
unzip -q "$pytriton_whl" 'pytriton/__init__.py' 'pytriton/tritonserver/bin/*' 'pytriton/tritonserver/backends/*' \
  'pytriton/tritonserver/caches/*' 'pytriton/tritonserver/python_backend_stubs/3.12/*' 'nvidia_pytriton.libs/*' -d "$tree"
find "$tree" -name __pycache__ -prune -exec rm -rf {} +
mv "$tree/nvidia_pytriton.libs" "$work/all_libs"
mkdir "$tree/nvidia_pytriton.libs"
stub=$tree/pytriton/tritonserver/python_backend_stubs/3.12/triton_python_backend_stub
server=$tree/pytriton/tritonserver/bin/tritonserver
queue=("$server" "$stub" $(find "$tree/pytriton/tritonserver/backends" "$tree/pytriton/tritonserver/caches" -name '*.so*'))
while [ ${#queue[@]} -gt 0 ]; do  # the NEEDED closure within the wheel's own libraries
  elf=${queue[0]}
  queue=("${queue[@]:1}")
  for lib in $(readelf -d "$elf" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    if [ -f "$work/all_libs/$lib" ] && [ ! -f "$tree/nvidia_pytriton.libs/$lib" ]; then
      cp "$work/all_libs/$lib" "$tree/nvidia_pytriton.libs/"
      queue+=("$tree/nvidia_pytriton.libs/$lib")
    fi
  done
done
find "$tree/pytriton/tritonserver" "$tree/nvidia_pytriton.libs" -type f ! -name '*.py' -exec strip --strip-unneeded {} +
chmod -R u+rwX,go+rX,go-w "$tree"
chmod +x "$server" "$stub"
echo "gpu_bundle: compressing tritonserver-min.tar.xz (xz with its x86 filter: a few minutes) ..."
tar -C "$tree" --owner=0 --group=0 --numeric-owner -cf - pytriton nvidia_pytriton.libs | xz --x86 --lzma2=preset=9e -T0 > "$bundle/tritonserver-min.tar.xz"

cp "$cache"/numpy-1.26.4-cp312-cp312-manylinux*.whl "$bundle/"

# tritonclient-py.zip: unpacked into site-packages by gpu_bench.sh; the clients only, without perf_analyzer.
client=$work/client
unzip -q "$(ls "$cache"/tritonclient-2.51.0-*.whl)" 'tritonclient-2.51.0.data/purelib/*' 'tritonclient-2.51.0.dist-info/*' \
  -d "$client"
mv "$client"/tritonclient-2.51.0.data/purelib/* "$client"/
rm -rf "$client/tritonclient-2.51.0.data"
unzip -q "$(ls "$cache"/python_rapidjson-1.25-cp312-*.whl)" -d "$client"
find "$client" -name __pycache__ -prune -exec rm -rf {} +
rm -f "$client"/*.dist-info/RECORD  # tritonclient's would list perf_analyzer
"$PYTHON" - "$client" "$bundle/tritonclient-py.zip" <<'EOF'
import sys
import zipfile
from pathlib import Path

root, target = Path(sys.argv[1]), sys.argv[2]
with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            archive.write(path, path.relative_to(root).as_posix())
EOF

# tokenizer.tgz: the files gpu_bench.py copies next to the random model (tokenizer*, chat_template*, special_tokens*).
(cd "$tokenizer_dir" && tar -czf - $(ls -d tokenizer* chat_template* special_tokens* 2>/dev/null)) > "$bundle/tokenizer.tgz"

if [ -z "${NO_OVERLAY:-}" ]; then
  download "$bundle/overlay" "$TRANSFORMERS" "$TOKENIZERS"
fi
if [ -z "${NO_SERVE:-}" ]; then
  download "$bundle/serve" "${SERVE[@]}"
fi
if [ -z "${NO_PYSPY:-}" ]; then
  download "$bundle/tools" "$PYSPY"
fi

# Every wheel recompressed with LZMA, which pip's zipfile reads: numpy's shared libraries shrink from 18 to 10 MB,
# and the bundle fits one transfer with everything in it.
echo "gpu_bundle: recompressing the wheels (LZMA: about a minute) ..."
find "$bundle" -name '*.whl' -print0 | xargs -0 "$PYTHON" -c '
import sys
import zipfile
from pathlib import Path

for wheel in map(Path, sys.argv[1:]):
    packed = wheel.with_suffix(".lzma")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(packed, "w", zipfile.ZIP_LZMA) as target:
        for member in source.infolist():
            data = source.read(member)
            member.compress_type = zipfile.ZIP_LZMA
            target.writestr(member, data)
    packed.replace(wheel)
'

# Checks: the server binary and the 3.12 stub are in the tarball, the bundle fits one transfer.
listing=$(xz -dc "$bundle/tritonserver-min.tar.xz" | tar -tf -)
for member in pytriton/tritonserver/bin/tritonserver pytriton/tritonserver/python_backend_stubs/3.12/triton_python_backend_stub \
  pytriton/tritonserver/backends/python/libtriton_python.so; do
  grep -qx "$member" <<<"$listing" || { echo "gpu_bundle: $member is missing from tritonserver-min.tar.xz" >&2; exit 1; }
done
(cd "$bundle" && find . -type f -printf '%P\t%s\n' | sort | awk -F'\t' '{printf "  %-64s %5.1f MiB\n", $1, $2 / 1048576}')
size=$(find "$bundle" -type f -printf '%s\n' | awk '{s += $1} END {print s}')
awk -v s="$size" -v b="$bundle" 'BEGIN {printf "gpu_bundle: %s, %.1f MiB in all\n", b, s / 1048576}'
if [ "$size" -gt $((limit_mib * 1048576)) ]; then
  echo "gpu_bundle: over $limit_mib MiB: it would not travel in one transfer (NO_PYSPY=1 or NO_SERVE=1 make it smaller)" >&2
  exit 1
fi
