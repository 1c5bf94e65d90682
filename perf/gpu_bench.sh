#!/usr/bin/env bash
# The GPU comparison on the lent NVIDIA H200 machine (no network): run from the repository root with
# the bundle in .whl/gpu (built on a machine with pip, see docs/PERFORMANCE.md):
#   tritonserver-min.zip   the tritonserver 2.51 binary, Python backend, 3.12 stub and the libraries they
#                          link, taken from the nvidia-pytriton 0.7.0 wheel (trimmed to fit one transfer)
#   numpy-1.26.4 (cp312)   the 2.51 stub corrupts BYTES tensors under numpy 2 (the image has 2.5)
#   tritonclient-py.zip    tritonclient 2.51.0's Python package, python_rapidjson: the clients
#   tokenizer.tgz          SmolLM2's tokenizer files (the random model has no tokenizer of its own)
# Like shared recipe gpu-tritonserver.sh, it makes a venv with numpy 1.26 that links every other
# package of the image except those that need numpy 2.
set -eu
bundle=.whl/gpu
mkdir -p /tmp/pyt /tmp/tok
python3 -m zipfile -e "$bundle/tritonserver-min.zip" /tmp/pyt
chmod +x /tmp/pyt/pytriton/tritonserver/bin/tritonserver /tmp/pyt/pytriton/tritonserver/python_backend_stubs/*/triton_python_backend_stub
tar xzf "$bundle/tokenizer.tgz" -C /tmp/tok
base_sp=$(python3 -c 'import site; print(site.getsitepackages()[0])')
python3 -m venv --without-pip /tmp/v312
sp=$(/tmp/v312/bin/python3 -c 'import site; print(site.getsitepackages()[0])')
python3 -m pip install -q --no-index --no-deps --upgrade --target "$sp" "$bundle"/*.whl
python3 -m zipfile -e "$bundle/tritonclient-py.zip" "$sp"
for e in "$base_sp"/*; do
  n=$(basename "$e")
  case "$n" in
    numpy*|scipy*|sklearn*|scikit_learn*|pandas*|numba*|cupy*|jax*|statsmodels*|seaborn*|matplotlib*|xarray*|skimage*|scikit_image*|pyarrow*|tensorstore*|opencv*|cv2*|onnx*|h5py*|tritonclient*) ;;
    *) [ -e "$sp/$n" ] || ln -s "$e" "$sp/$n" ;;
  esac
done
export PYTHONPATH=/tmp/pyt:$PWD PYTHONUNBUFFERED=1
exec /tmp/v312/bin/python3 perf/gpu_bench.py --tokenizer-dir /tmp/tok "$@"
