/* netweave: NCCL tuner plugin (ncclTunerPlugin_v6, v5): per-communicator algorithm,
 * protocol, channel and chunk-size hints from the flow plan's `tune` rules. The first
 * matching rule wins; a communicator is matched by commId, by its class (learnt from the
 * net plugin's per-communicator init in the same library) or by its init order. */
#define _GNU_SOURCE
#include <stdlib.h>

#include "nw.h"

typedef struct {
  uint64_t commId;
  size_t nRanks, nNodes;
} tuner_ctx_t;

static const nw_tune_rule_t* find_rule(const nw_plan_t* plan, const tuner_ctx_t* t, int coll, size_t nBytes) {
  int order = -1, ncclClass = -1, eff = -1;
  nw_registry_lookup(t->commId, &order, &ncclClass, &eff);
  for (int i = 0; i < plan->ntune; i++) {
    const nw_tune_rule_t* r = &plan->tune[i];
    int hit = r->sel == NW_SEL_ANY || (r->sel == NW_SEL_COMM && r->id == t->commId) ||
              (r->sel == NW_SEL_CLASS && eff >= 0 && r->id == (uint64_t)eff) ||
              (r->sel == NW_SEL_ORDER && order >= 0 && r->id == (uint64_t)order);
    if (!hit) continue;
    if (r->coll != NW_UNSET && r->coll != coll) continue;
    if (nBytes < r->min_bytes || nBytes > r->max_bytes) continue;
    return r;
  }
  return NULL;
}

static ncclResult_t tuner_init(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction,
                               ncclNvlDomainInfo_v5_t* nvl, ncclTunerConstants_v5_t* constants) {
  (void)nvl; (void)constants;
  if (logFunction != NULL && nw_logger == NULL) nw_logger = logFunction;
  tuner_ctx_t* t = calloc(1, sizeof(*t));
  if (t == NULL) return ncclSystemError;
  t->commId = commId;
  t->nRanks = nRanks;
  t->nNodes = nNodes;
  *ctx = t;
  NW_INFO(NCCL_INIT | NCCL_TUNING, "tuner init comm %lx nRanks %zu nNodes %zu", (unsigned long)commId, nRanks, nNodes);
  return ncclSuccess;
}

static ncclResult_t tuner_coll_info(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps, float** collCostTable,
                                    int numAlgo, int numProto, int regBuff, int* nChannels) {
  (void)numPipeOps; (void)regBuff;
  nw_plan_t* plan = malloc(sizeof(*plan));
  if (plan == NULL) return ncclSuccess;
  nw_plan_snapshot(plan);
  const nw_tune_rule_t* r = find_rule(plan, context, (int)collType, nBytes);
  if (r != NULL) {
    /* collCostTable is a numAlgo x numProto float matrix; 0.0 selects, -1.0 (ignore) marks unsupported */
    float* table = (float*)collCostTable;
    if (r->algo != NW_UNSET && r->algo < numAlgo && r->proto < numProto) {
      float* cell = &table[r->algo * numProto + r->proto];
      if (*cell != NCCL_ALGO_PROTO_IGNORE) {
        *cell = 0.0f;
        NW_INFO(NCCL_TUNING, "tuner: coll %d %zu bytes -> algo %d proto %d", (int)collType, nBytes, r->algo, r->proto);
      }
    }
    if (r->channels != NW_UNSET) *nChannels = r->channels;
  }
  free(plan);
  return ncclSuccess;
}

static ncclResult_t tuner_chunk(void* context, ncclFunc_t collType, size_t nBytes, int algo, int proto, int nChannels, size_t* chunkSize) {
  (void)algo; (void)proto; (void)nChannels;
  nw_plan_t* plan = malloc(sizeof(*plan));
  if (plan == NULL) return ncclSuccess;
  nw_plan_snapshot(plan);
  const nw_tune_rule_t* r = find_rule(plan, context, (int)collType, nBytes);
  if (r != NULL && r->chunk != NW_UNSET) *chunkSize = (size_t)r->chunk; /* NCCL clamps to its buffer limits */
  free(plan);
  return ncclSuccess;
}

static ncclResult_t tuner_finalize(void* context) {
  free(context);
  return ncclSuccess;
}

NW_EXPORT const ncclTuner_v6_t ncclTunerPlugin_v6 = {NW_PLUGIN_NAME, tuner_init, tuner_coll_info, tuner_finalize, tuner_chunk};
NW_EXPORT const ncclTuner_v5_t ncclTunerPlugin_v5 = {NW_PLUGIN_NAME, tuner_init, tuner_coll_info, tuner_finalize};
