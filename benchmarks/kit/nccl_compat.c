/* Stand-ins for the NCCL entry points that torch 2.14.0 links and NCCL 2.28 (the GPU image's, pinned
 * by its torch 2.11) does not define. Python binds every symbol of an extension when it loads it, so
 * without these `import torch` fails on the first one. Each fails with ncclInvalidUsage (5); a run on
 * one GPU calls none of them. benchmarks/gpu_kit.sh builds this into the kit unless given --nccl,
 * which carries the NCCL torch pins instead. The list is `nm -D --undefined-only libtorch_cuda.so`
 * against `nm -D --defined-only libnccl.so.2` of 2.28.9. */
#define STAND_IN(name) int name(void) { return 5; }
STAND_IN(ncclCommGetUniqueId)
STAND_IN(ncclCommGrow)
STAND_IN(ncclCommMemStats)
STAND_IN(ncclCommResume)
STAND_IN(ncclCommSuspend)
STAND_IN(ncclGetLsaMultimemDevicePointer)
STAND_IN(ncclGetPeerDevicePointer)
STAND_IN(ncclPutSignal)
STAND_IN(ncclSignal)
STAND_IN(ncclWaitSignal)
STAND_IN(ncclWinGetUserPtr)
