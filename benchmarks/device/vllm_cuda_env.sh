# Sourced by the device scripts that run vLLM's CUDA build 0.26: joins the carried pieces (`make_vllm_cuda_carry.sh`,
# copied to /root/vcparts/ by the calls before) and installs them into /tmp/vc-site once a machine, then sets the
# environment they run in (the 0.26 shim, the carried redis-server, NCCL without NVLink multicast).
if [ ! -d /tmp/vc-site/vllm ]; then
  mkdir -p /root/vc && cat /root/vcparts/part.* | tar -xf - -C /root/vc && bash /root/vc/install.sh
fi
export PYTHONPATH="$PWD/benchmarks/device/vllm026:$PWD:/tmp/vc-site" PATH="/root/vc/bin:$PATH" \
  ROLLOUTS_REDIS_SERVER=/root/vc/bin/redis-server VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 VLLM_LOGGING_STREAM=ext://sys.stderr
