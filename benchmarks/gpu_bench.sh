#!/usr/bin/env bash
# The GPU comparison (benchmarks/gpu_bench.py) on an NVIDIA GPU host with no network. Two commands, from
# the repository root: the first on a machine with pip (it writes .whl/gpu; bring that folder along),
# the second on the GPU host:
#   bash benchmarks/gpu_bundle.sh
#   bash benchmarks/gpu_bench.sh [gpu_bench.py options]
# GPU_SCRIPT=benchmarks/pipeline.py runs the pipeline benchmark there instead, with the same environment.
# What it reads from .whl/gpu:
#   tritonserver-min.tar.xz  the tritonserver 2.51 binary, Python backend, 3.12 stub and the libraries they
#                          link, taken from the nvidia-pytriton 0.7.0 wheel (trimmed and stripped to fit one
#                          transfer)
#   numpy-1.26.4 (cp312)   the 2.51 stub corrupts BYTES tensors under numpy 2
#   tritonclient-py.zip    tritonclient 2.51.0's Python package, python_rapidjson: the clients
#   tokenizer.tgz          SmolLM2's tokenizer files (the random model has no tokenizer of its own)
#   overlay/*.whl          optional: the project's transformers and tokenizers wheels, used instead of the
#                          host's when they import there (the report names the transformers release)
#   tools/py_spy-*.whl     optional: py-spy, for --profile-dir
#   serve/*.whl            optional: the OpenAI layer's web stack (benchmarks/pipeline.py runs it)
# It makes a venv with numpy 1.26 that links every other package of the host's Python (torch, ...) except
# those that need numpy 2.
set -eu
bundle=.whl/gpu
[ -f "$bundle/tritonserver-min.tar.xz" ] || {
  echo "gpu_bench: no bundle in $bundle: build it with 'bash benchmarks/gpu_bundle.sh' on a machine with pip" >&2
  exit 1
}
mkdir -p /tmp/pyt /tmp/tok
tar xJf "$bundle/tritonserver-min.tar.xz" -C /tmp/pyt
chmod +x /tmp/pyt/pytriton/tritonserver/bin/tritonserver /tmp/pyt/pytriton/tritonserver/python_backend_stubs/*/triton_python_backend_stub
tar xzf "$bundle/tokenizer.tgz" -C /tmp/tok
base_sp=$(python3 -c 'import site; print(site.getsitepackages()[0])')
python3 -m venv --without-pip /tmp/v312
sp=$(/tmp/v312/bin/python3 -c 'import site; print(site.getsitepackages()[0])')
python3 -m pip install -q --no-index --no-deps --upgrade --target "$sp" "$bundle"/*.whl
python3 -m zipfile -e "$bundle/tritonclient-py.zip" "$sp"
if ls "$bundle"/serve/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target "$sp" "$bundle"/serve/*.whl
fi
overlay=""
if ls "$bundle"/overlay/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/overlay "$bundle"/overlay/*.whl
  overlay="transformers tokenizers"
fi
link_image_packages() {  # every package of the image but those needing numpy 2 and those named in $1
  for e in "$base_sp"/*; do
    n=$(basename "$e")
    case "$n" in
      numpy*|scipy*|sklearn*|scikit_learn*|pandas*|numba*|cupy*|jax*|statsmodels*|seaborn*|matplotlib*|xarray*|skimage*|scikit_image*|pyarrow*|tensorstore*|opencv*|cv2*|onnx*|h5py*|tritonclient*) continue ;;
    esac
    for own in $1; do case "$n" in "$own"*) continue 2 ;; esac; done
    [ -e "$sp/$n" ] || ln -s "$e" "$sp/$n"
  done
}
if [ -n "$overlay" ]; then
  cp -r /tmp/overlay/. "$sp"/
  link_image_packages "$overlay"
  if ! /tmp/v312/bin/python3 -c 'import transformers.generation.continuous_batching' 2>/tmp/overlay.err; then
    echo "overlay does not import here, using the image's transformers: $(tail -1 /tmp/overlay.err)"
    (cd /tmp/overlay && for n in *; do rm -rf "${sp:?}/$n"; done)
    overlay=""
  fi
fi
link_image_packages ""
if ls "$bundle"/tools/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/tools "$bundle"/tools/*.whl
  export PATH=/tmp/tools/bin:$PATH
fi
export PYTHONPATH=/tmp/pyt:$PWD PYTHONUNBUFFERED=1
exec /tmp/v312/bin/python3 "${GPU_SCRIPT:-benchmarks/gpu_bench.py}" --tokenizer-dir /tmp/tok "$@"
