# Source on the device machine (repo root as cwd): puts the repo's packages and the carried wheels on
# PYTHONPATH without installing (the image has no network). Keeps NVLink multicast off everywhere.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/pp /tmp/site
ln -sfn "$PWD/formats" /tmp/pp/ninfer_formats
ln -sfn "$PWD/kernels" /tmp/pp/ninfer_kernels
if ls .whl/*.whl >/dev/null 2>&1; then
  # fla goes to its own folder: its chunk backward refuses Triton < 3.7.1 on Hopper (see below)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v -e fla_core -e flash_linear) >/dev/null 2>&1 || echo "wheel install failed" >&2
  mkdir -p /tmp/fla && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/fla .whl/fla_core*.whl >/dev/null 2>&1 || true
fi
# fla's forward (GDN chunked prefill) is on unless NINFER_WITH_FLA=0 (training scripts: its backward refuses
# this Triton on Hopper). Set the variable before sourcing: a later export does not reach PYTHONPATH.
if [ "${NINFER_WITH_FLA:-1}" = "0" ]; then
  export PYTHONPATH=/tmp/pp:$PWD:/tmp/site
else
  export PYTHONPATH=/tmp/pp:$PWD:/tmp/site:/tmp/fla
fi
