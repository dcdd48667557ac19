# The C++ and CUDA sources of ringreduce, written once: CMakeLists.txt (and csrc/cuda/CMakeLists.txt)
# include this file, setup.py and tests/test_cuda_logic.py read it (with tools/source_list.py;
# none of them lists a file itself). Paths are from the repository root. Every .cpp and .cu under csrc/
# is in exactly one group (tests/tools/test_source_list.py). A group says what its files need:
#
#   core          nothing: torch-free, CUDA-free (the plan, the executors' arithmetic, the frames)
#   cpu           the host runtime below the CPU ring: POSIX threads and shared memory, no torch
#   cpu_torch     c10d's headers: compiled inside csrc/torch/cpu_ops.cpp, which #includes it
#                 (setup.py's Note [First-build time]), so it is never a translation unit of its own
#   torch         torch's headers: the bindings and the CPU ops
#   torch_cuda    torch's and CUDA's headers: the CUDA bindings
#   cuda_logic    neither torch nor CUDA: the GPU ring's driver and pipeline rule, tested on the host
#                 (the simulated device, tests/test_cuda_logic.py)
#   cuda_runtime  the CUDA runtime's and NCCL's headers: tested on the fake CUDA runtime and NCCL
#                 (tests/cpp/cuda/fake_cuda.h)
#   cuda_device   a CUDA compiler and a device: the kernels and what launches them

set(RR_SOURCES_core
  csrc/core/agreement.cpp
  csrc/core/collectives.cpp
  csrc/core/direct.cpp
  csrc/core/dtype.cpp
  csrc/core/frame.cpp
  csrc/core/plan.cpp
)
set(RR_SOURCES_cpu
  csrc/cpu/direct_exchange.cpp
  csrc/cpu/group_runtime.cpp
  csrc/cpu/host_isa.cpp
  csrc/cpu/host_reduce.cpp
  csrc/cpu/node_pipeline.cpp
  csrc/cpu/ring_executor.cpp
  csrc/cpu/runtime_registry.cpp
  csrc/cpu/shm_path.cpp
  csrc/cpu/shm_ring.cpp
  csrc/cpu/shm_segment.cpp
)
set(RR_SOURCES_cpu_torch
  csrc/cpu/c10d_transport.cpp
)
set(RR_SOURCES_torch
  csrc/torch/bindings.cpp
  csrc/torch/cpu_ops.cpp
)
set(RR_SOURCES_torch_cuda
  csrc/torch/cuda_bindings.cpp
)
set(RR_SOURCES_cuda_logic
  csrc/cuda/direct_executor.cpp
  csrc/cuda/gpu_pipeline.cpp
  csrc/cuda/ring_executor.cpp
)
set(RR_SOURCES_cuda_runtime
  csrc/cuda/cuda_ops.cpp
  csrc/cuda/cuda_work.cpp
  csrc/cuda/group_runtime.cpp
  csrc/cuda/nccl_comm.cpp
  csrc/cuda/nccl_frame_transport.cpp
)
set(RR_SOURCES_cuda_device
  csrc/cuda/loopback_ring.cpp
  csrc/cuda/one_shot_kernels.cu
  csrc/cuda/reduce_kernels.cu
  csrc/cuda/reduce_kernels_half.cu
)
