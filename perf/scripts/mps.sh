# Sourced by the device scripts: with MPS=1, starts a CUDA MPS daemon (its pipe and log under
# /tmp/okv-mps) for every CUDA process started after it, logs to $1, and stops it when the
# script exits.
if [ "$MPS" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/okv-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/okv-mps/log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d >> "$1" 2>&1; echo "mps daemon rc=$?" >> "$1"
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
