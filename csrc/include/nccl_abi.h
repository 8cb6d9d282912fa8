/* netweave: our own declarations of the NCCL plugin ABI (net v10-v12, tuner v5-v6,
 * profiler v5-v6), written from the documented layout of NCCL 2.30.7's public plugin
 * headers (src/include/plugin/...). Only the types the plugin touches are declared;
 * members are in NCCL's order so the structs are layout-compatible. No NCCL or CUDA
 * headers are needed to build. */
#ifndef NETWEAVE_NCCL_ABI_H_
#define NETWEAVE_NCCL_ABI_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

typedef enum {
  NCCL_LOG_NONE = 0, NCCL_LOG_VERSION = 1, NCCL_LOG_WARN = 2,
  NCCL_LOG_INFO = 3, NCCL_LOG_ABORT = 4, NCCL_LOG_TRACE = 5
} ncclDebugLogLevel;

enum { NCCL_INIT = 0x1, NCCL_NET = 0x10, NCCL_TUNING = 0x40, NCCL_PROFILE = 0x4000 };

typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
                                  const char* fmt, ...);
typedef ncclResult_t (*ncclProfilerCallback_t)(void** eHandle, int type, void* pHandle, int64_t pluginId,
                                               void* extData);

typedef enum {
  ncclFuncBroadcast = 0, ncclFuncReduce = 1, ncclFuncAllGather = 2, ncclFuncReduceScatter = 3,
  ncclFuncAllReduce = 4, ncclFuncSendRecv = 5, ncclFuncSend = 6, ncclFuncRecv = 7, ncclFuncAlltoAll = 8,
  ncclFuncScatter = 9, ncclFuncGather = 10, ncclFuncAllGatherV = 11, ncclNumFuncsKnown = 12
} ncclFunc_t;

/* ---------------------------------------------------------------- net -- */
#define NCCL_NET_HANDLE_MAXSIZE 128
#define NCCL_PTR_HOST 0x1
#define NCCL_PTR_CUDA 0x2
#define NCCL_PTR_DMABUF 0x4
#define NCCL_NET_MAX_REQUESTS 32
#define NCCL_MAX_NET_SIZE_BYTES (1LL * 1024 * 1024 * 1024 * 1024)
#define NCCL_MAX_COLLNET_SIZE (512LL * 1024 * 1024)
#define NCCL_NET_TRAFFIC_CLASS_UNDEF (-1)
#define NCCL_NET_ID_UNDEF (-1)

typedef enum { NCCL_NET_DEVICE_HOST = 0, NCCL_NET_DEVICE_UNPACK = 1 } ncclNetDeviceType;
#define NCCL_NET_DEVICE_INVALID_VERSION 0x0

/* Device offload handle: opaque to a host-only plugin (we never offer offload). */
typedef struct ncclNetDeviceHandle_opaque ncclNetDeviceHandle_t;

typedef struct { int trafficClass; } ncclNetCommConfig_t; /* identical in v10, v11, v12 */

typedef struct { int ndevs; int devs[4]; } ncclNetVDeviceProps_v10_t; /* v10 and v11: 4 devices per vNIC */
typedef ncclNetVDeviceProps_v10_t ncclNetVDeviceProps_v11_t;
typedef struct { int ndevs; int devs[8]; } ncclNetVDeviceProps_v12_t; /* v12: 8 */

#define NCCL_NET_PROPS_COMMON(VPROPS)                                                                     \
  char* name; char* pciPath; uint64_t guid; int ptrSupport; int regIsGlobal; int forceFlush; int speed;    \
  int port; float latency; int maxComms; int maxRecvs; ncclNetDeviceType netDeviceType;                    \
  int netDeviceVersion; VPROPS vProps; size_t maxP2pBytes; size_t maxCollBytes;

typedef struct { NCCL_NET_PROPS_COMMON(ncclNetVDeviceProps_v10_t) } ncclNetProperties_v10_t;
typedef struct { NCCL_NET_PROPS_COMMON(ncclNetVDeviceProps_v11_t) int maxMultiRequestSize; } ncclNetProperties_v11_t;
typedef struct {
  NCCL_NET_PROPS_COMMON(ncclNetVDeviceProps_v12_t)
  int maxMultiRequestSize;
  int16_t railId;
  int16_t planeId;
} ncclNetProperties_v12_t;

typedef struct { int32_t maxConcurrentPeers, minConcurrentPeers, maxFlowsPerPeer, minFlowsPerPeer; } ncclNetCommAttr_t;
typedef struct {
  ncclNetCommAttr_t sendCommAttr;
  ncclNetCommAttr_t recvCommAttr;
  uint32_t op;    /* ncclFunc_t of the following traffic, or (uint32_t)-1 */
  uint32_t algo;
  uint32_t proto;
} ncclNetAttr_t; /* identical in v11 and v12 */

/* The common tail of the v10..v12 function tables, after the version-specific head. */
#define NCCL_NET_TABLE_TAIL(PROPS, VPROPS)                                                                        \
  ncclResult_t (*accept)(void* listenComm, void** recvComm, ncclNetDeviceHandle_t** recvDevComm);                  \
  ncclResult_t (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);                            \
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,              \
                              void** mhandle);                                                                     \
  ncclResult_t (*deregMr)(void* comm, void* mhandle);                                                              \
  ncclResult_t (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle, void* phandle,            \
                        void** request);                                                                           \
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,             \
                        void** phandles, void** request);                                                          \
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles, void** request);        \
  ncclResult_t (*test)(void* request, int* done, int* sizes);                                                      \
  ncclResult_t (*closeSend)(void* sendComm);                                                                       \
  ncclResult_t (*closeRecv)(void* recvComm);                                                                       \
  ncclResult_t (*closeListen)(void* listenComm);                                                                   \
  ncclResult_t (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);                                     \
  ncclResult_t (*irecvConsumed)(void* recvComm, int n, void* request);                                             \
  ncclResult_t (*makeVDevice)(int* d, VPROPS* props);

typedef struct {
  const char* name;
  ncclResult_t (*init)(ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction);
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v10_t* props);
  ncclResult_t (*listen)(int dev, void* handle, void** listenComm);
  ncclResult_t (*connect)(int dev, ncclNetCommConfig_t* config, void* handle, void** sendComm,
                          ncclNetDeviceHandle_t** sendDevComm);
  NCCL_NET_TABLE_TAIL(ncclNetProperties_v10_t, ncclNetVDeviceProps_v10_t)
} ncclNet_v10_t;

#define NCCL_NET_TABLE_V11_LIKE(PROPS, VPROPS)                                                                      \
  const char* name;                                                                                                  \
  ncclResult_t (*init)(void** ctx, uint64_t commId, ncclNetCommConfig_t* config, ncclDebugLogger_t logFunction,      \
                       ncclProfilerCallback_t profFunction);                                                        \
  ncclResult_t (*devices)(int* ndev);                                                                                \
  ncclResult_t (*getProperties)(int dev, PROPS* props);                                                              \
  ncclResult_t (*listen)(void* ctx, int dev, void* handle, void** listenComm);                                       \
  ncclResult_t (*connect)(void* ctx, int dev, void* handle, void** sendComm, ncclNetDeviceHandle_t** sendDevComm);   \
  NCCL_NET_TABLE_TAIL(PROPS, VPROPS)                                                                                 \
  ncclResult_t (*finalize)(void* ctx);                                                                               \
  ncclResult_t (*setNetAttr)(void* ctx, ncclNetAttr_t* netAttr);

typedef struct { NCCL_NET_TABLE_V11_LIKE(ncclNetProperties_v11_t, ncclNetVDeviceProps_v11_t) } ncclNet_v11_t;
typedef struct { NCCL_NET_TABLE_V11_LIKE(ncclNetProperties_v12_t, ncclNetVDeviceProps_v12_t) } ncclNet_v12_t;

/* -------------------------------------------------------------- tuner -- */
#define NCCL_ALGO_PROTO_IGNORE (-1.0f)
enum { NCCL_ALGO_TREE = 0, NCCL_ALGO_RING = 1, NCCL_ALGO_COLLNET_DIRECT = 2, NCCL_ALGO_COLLNET_CHAIN = 3,
       NCCL_ALGO_NVLS = 4, NCCL_ALGO_NVLS_TREE = 5, NCCL_ALGO_PAT = 6, NCCL_NUM_ALGORITHMS_KNOWN = 7 };
enum { NCCL_PROTO_LL = 0, NCCL_PROTO_LL128 = 1, NCCL_PROTO_SIMPLE = 2, NCCL_NUM_PROTOCOLS_KNOWN = 3 };

typedef struct { int nNvlDomains; int minRanksPerNvlDomain; int maxRanksPerNvlDomain; } ncclNvlDomainInfo_v5_t;
typedef struct {
  double baseLatencies[7][3];
  double hwLatencies[3][7][3];
  double llMaxBws[4][3];
  double perChMaxRingLL128Bws[4][3];
  double perChMaxTreeLL128Bws[4][3];
  double perChMaxTreeBws[4][3];
  double perChMaxNVLSTreeBws[4][3];
} ncclTunerConstants_v5_t;

#define NCCL_TUNER_TABLE_V5_HEAD                                                                                     \
  const char* name;                                                                                                  \
  ncclResult_t (*init)(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction,     \
                       ncclNvlDomainInfo_v5_t* nvlDomainInfo, ncclTunerConstants_v5_t* constants);                    \
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,                     \
                              float** collCostTable, int numAlgo, int numProto, int regBuff, int* nChannels);       \
  ncclResult_t (*finalize)(void* context);

typedef struct { NCCL_TUNER_TABLE_V5_HEAD } ncclTuner_v5_t;
typedef struct {
  NCCL_TUNER_TABLE_V5_HEAD
  ncclResult_t (*getChunkSize)(void* context, ncclFunc_t collType, size_t nBytes, int algo, int proto, int nChannels,
                               size_t* chunkSize);
} ncclTuner_v6_t;

/* ----------------------------------------------------------- profiler -- */
enum {
  ncclProfileGroup = (1 << 0), ncclProfileColl = (1 << 1), ncclProfileP2p = (1 << 2),
  ncclProfileProxyOp = (1 << 3), ncclProfileProxyStep = (1 << 4), ncclProfileProxyCtrl = (1 << 5),
  ncclProfileKernelCh = (1 << 6), ncclProfileNetPlugin = (1 << 7), ncclProfileGroupApi = (1 << 8),
  ncclProfileCollApi = (1 << 9), ncclProfileP2pApi = (1 << 10), ncclProfileKernelLaunch = (1 << 11),
};

typedef enum {
  ncclProfilerProxyStepSendGPUWait = 8, ncclProfilerProxyStepSendWait = 9, ncclProfilerProxyStepRecvWait = 10,
  ncclProfilerProxyStepRecvFlushWait = 11, ncclProfilerProxyStepRecvGPUWait = 12,
  ncclProfilerProxyStepSendPeerWait_v4 = 20,
} ncclProfilerEventState_t;

/* v5 and v6 descriptors share every member the plugin reads (v6 only appends CE structs
 * to the union), so one declaration with the v5 union serves both: the plugin reads
 * through a pointer and never depends on the union's total size. */
typedef struct {
  uint64_t type;
  void* parentObj;
  int rank;
  union {
    struct { bool graphCaptured; int groupDepth; } groupApi;
    struct { const char* func; size_t count; const char* datatype; int root; void* stream; bool graphCaptured; } collApi;
    struct { const char* func; size_t count; const char* datatype; void* stream; bool graphCaptured; } p2pApi;
    struct { void* stream; } kernelLaunch;
    struct {
      uint64_t seqNumber; const char* func; void const* sendBuff; void* recvBuff; size_t count; int root;
      const char* datatype; uint8_t nChannels; uint8_t nWarps; const char* algo; const char* proto; void* parentGroup;
    } coll;
    struct { const char* func; void* buff; const char* datatype; size_t count; int peer; uint8_t nChannels; void* parentGroup; } p2p;
    struct { pid_t pid; uint8_t channelId; int peer; int nSteps; int chunkSize; int isSend; } proxyOp;
    struct { int step; } proxyStep;
    struct { uint8_t channelId; uint64_t pTimer; } kernelCh;
    struct { int64_t id; void* data; } netPlugin;
  };
} ncclProfilerEventDescr_t;

typedef union {
  struct { size_t transSize; } proxyStep;
  struct { int appendedProxyOps; } proxyCtrl;
  struct { void* data; } netPlugin;
  struct { uint64_t pTimer; } kernelCh;
} ncclProfilerEventStateArgs_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** context, uint64_t commId, int* eActivationMask, const char* commName, int nNodes,
                       int nranks, int rank, ncclDebugLogger_t logfn);
  ncclResult_t (*startEvent)(void* context, void** eHandle, ncclProfilerEventDescr_t* eDescr);
  ncclResult_t (*stopEvent)(void* eHandle);
  ncclResult_t (*recordEventState)(void* eHandle, ncclProfilerEventState_t eState, ncclProfilerEventStateArgs_t* eStateArgs);
  ncclResult_t (*finalize)(void* context);
} ncclProfiler_v6_t; /* ncclProfiler_v5_t has the same table */
typedef ncclProfiler_v6_t ncclProfiler_v5_t;

#endif
