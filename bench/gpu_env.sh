# Sourced by every bench/run_*.sh on the GPU machine (repo root, .whl carried): unbuffered
# output, NVLink multicast off (the lent machines do not allow it), the carried wheels
# installed into /tmp/site, and PYTHONPATH set so this checkout's tpserve is imported.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
