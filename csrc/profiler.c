/* netweave: NCCL profiler plugin (ncclProfiler_v6, v5): collective, p2p, proxy-op and
 * proxy-step events into the shared-memory ring of ring.c. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "nw.h"

typedef struct {
  uint64_t commId;
  int rank;
  int nranks;
} prof_ctx_t;

typedef struct {
  prof_ctx_t* ctx;
  uint32_t id, parent_id;
  uint16_t stop_kind;
  uint64_t coll_seq, bytes;
  uint8_t func, algo, proto, channel, is_send;
  int32_t peer, step;
} prof_event_t;

static size_t dtype_size(const char* t) {
  if (t == NULL) return 0;
  if (strncmp(t, "ncclFloat8", 10) == 0) return 1;
  static const struct { const char* n; size_t s; } tbl[] = {
      {"ncclInt8", 1}, {"ncclChar", 1}, {"ncclUint8", 1}, {"ncclInt32", 4}, {"ncclInt", 4}, {"ncclUint32", 4},
      {"ncclInt64", 8}, {"ncclUint64", 8}, {"ncclFloat16", 2}, {"ncclHalf", 2}, {"ncclFloat32", 4},
      {"ncclFloat", 4}, {"ncclFloat64", 8}, {"ncclDouble", 8}, {"ncclBfloat16", 2}};
  for (size_t i = 0; i < sizeof(tbl) / sizeof(tbl[0]); i++)
    if (strcmp(t, tbl[i].n) == 0) return tbl[i].s;
  return 0;
}

static uint8_t small(int v) { return v < 0 ? 0xff : (uint8_t)v; }

static int8_t comm_class(uint64_t commId) {
  int eff = -1;
  if (nw_registry_lookup(commId, NULL, NULL, &eff) != 0) return -1;
  return (int8_t)eff;
}

static void emit(prof_event_t* e, uint16_t kind, uint64_t bytes, int32_t step) {
  nw_ring_t* ring = nw_ring_get();
  if (ring == NULL) return;
  nw_record_t r;
  memset(&r, 0, sizeof(r));
  r.kind = kind;
  r.comm_id = e->ctx->commId;
  r.coll_seq = e->coll_seq;
  r.bytes = bytes;
  r.event_id = e->id;
  r.parent_id = e->parent_id;
  r.func = e->func;
  r.algo = e->algo;
  r.proto = e->proto;
  r.channel = e->channel;
  r.is_send = e->is_send;
  r.traffic_class = comm_class(e->ctx->commId);
  r.peer = e->peer;
  r.step = step;
  nw_ring_put(ring, &r);
}

static ncclResult_t prof_init(void** context, uint64_t commId, int* eActivationMask, const char* commName, int nNodes,
                              int nranks, int rank, ncclDebugLogger_t logfn) {
  (void)commName; (void)nNodes;
  if (logfn != NULL && nw_logger == NULL) nw_logger = logfn;
  prof_ctx_t* ctx = calloc(1, sizeof(*ctx));
  if (ctx == NULL) return ncclSystemError;
  ctx->commId = commId;
  ctx->rank = rank;
  ctx->nranks = nranks;
  *context = ctx;
  int mask = ncclProfileColl | ncclProfileP2p | ncclProfileProxyOp | ncclProfileProxyStep;
  const char* m = getenv("NETWEAVE_PROF_MASK");
  if (m != NULL && m[0] != '\0') mask = (int)strtol(m, NULL, 0);
  /* without a ring there is nowhere to put events: ask NCCL for none */
  *eActivationMask = nw_ring_get() != NULL ? mask : 0;
  NW_INFO(NCCL_INIT | NCCL_PROFILE, "profiler init comm %lx rank %d/%d mask 0x%x", (unsigned long)commId, rank, nranks,
          *eActivationMask);
  return ncclSuccess;
}

static ncclResult_t prof_start(void* context, void** eHandle, ncclProfilerEventDescr_t* d) {
  *eHandle = NULL;
  prof_ctx_t* ctx = context;
  uint16_t start_kind;
  prof_event_t* e = calloc(1, sizeof(*e));
  if (e == NULL) return ncclSuccess; /* profiling is best effort: never fail NCCL */
  e->ctx = ctx;
  e->id = nw_next_event_id();
  e->peer = -1;
  e->func = e->algo = e->proto = e->channel = 0xff;
  prof_event_t* parent = d->parentObj;
  if (parent != NULL && d->type != ncclProfileColl && d->type != ncclProfileP2p) {
    e->parent_id = parent->id;
    e->coll_seq = parent->coll_seq;
    e->func = parent->func;
    e->algo = parent->algo;
    e->proto = parent->proto;
    e->channel = parent->channel;
    e->is_send = parent->is_send;
    e->peer = parent->peer;
  }
  uint64_t bytes = 0;
  int32_t step = -1;
  switch (d->type) {
    case ncclProfileColl:
      e->coll_seq = d->coll.seqNumber;
      e->func = small(nw_func_from_name(d->coll.func));
      e->algo = small(nw_algo_from_name(d->coll.algo));
      e->proto = small(nw_proto_from_name(d->coll.proto));
      e->channel = d->coll.nChannels;
      size_t es = dtype_size(d->coll.datatype);
      bytes = d->coll.count * (es ? es : 1);
      e->peer = d->coll.root;
      start_kind = NW_EV_COLL_START;
      e->stop_kind = NW_EV_COLL_STOP;
      break;
    case ncclProfileP2p:
      e->func = small(nw_func_from_name(d->p2p.func));
      e->channel = d->p2p.nChannels;
      size_t ps = dtype_size(d->p2p.datatype);
      bytes = d->p2p.count * (ps ? ps : 1);
      e->peer = d->p2p.peer;
      start_kind = NW_EV_P2P_START;
      e->stop_kind = NW_EV_P2P_STOP;
      break;
    case ncclProfileProxyOp:
      e->channel = d->proxyOp.channelId;
      e->peer = d->proxyOp.peer;
      e->is_send = (uint8_t)(d->proxyOp.isSend != 0);
      bytes = (uint64_t)(d->proxyOp.nSteps > 0 ? d->proxyOp.nSteps : 0) * (uint64_t)(d->proxyOp.chunkSize > 0 ? d->proxyOp.chunkSize : 0);
      step = d->proxyOp.nSteps;
      start_kind = NW_EV_PROXYOP_START;
      e->stop_kind = NW_EV_PROXYOP_STOP;
      break;
    case ncclProfileProxyStep:
      e->step = d->proxyStep.step;
      step = e->step;
      start_kind = NW_EV_STEP_START;
      e->stop_kind = NW_EV_STEP_STOP;
      break;
    default:
      free(e);
      return ncclSuccess;
  }
  e->bytes = bytes;
  emit(e, start_kind, bytes, step);
  *eHandle = e;
  return ncclSuccess;
}

static ncclResult_t prof_stop(void* eHandle) {
  prof_event_t* e = eHandle;
  if (e == NULL) return ncclSuccess;
  emit(e, e->stop_kind, e->bytes, e->stop_kind == NW_EV_STEP_STOP ? e->step : -1);
  free(e);
  return ncclSuccess;
}

static ncclResult_t prof_record(void* eHandle, ncclProfilerEventState_t state, ncclProfilerEventStateArgs_t* args) {
  prof_event_t* e = eHandle;
  if (e == NULL || e->stop_kind != NW_EV_STEP_STOP) return ncclSuccess;
  /* proxy steps: the state transition (step field = state), bytes = transSize when given */
  if (args != NULL && (state == ncclProfilerProxyStepSendWait || state == ncclProfilerProxyStepRecvFlushWait ||
                       state == ncclProfilerProxyStepRecvGPUWait || state == ncclProfilerProxyStepSendPeerWait_v4))
    e->bytes = args->proxyStep.transSize;
  emit(e, NW_EV_STEP_STATE, e->bytes, (int32_t)state);
  return ncclSuccess;
}

static ncclResult_t prof_finalize(void* context) {
  free(context);
  return ncclSuccess;
}

NW_EXPORT const ncclProfiler_v6_t ncclProfiler_v6 = {NW_PLUGIN_NAME, prof_init, prof_start, prof_stop, prof_record, prof_finalize};
NW_EXPORT const ncclProfiler_v5_t ncclProfiler_v5 = {NW_PLUGIN_NAME, prof_init, prof_start, prof_stop, prof_record, prof_finalize};
