/* netweave test harness for the profiler ring: loads the plugin library with dlopen,
 * takes ncclProfiler_v6 (falling back to v5) and replays synthetic NCCL events through
 * its function table: per collective one Coll event, `proxyops` ProxyOp children and
 * `steps` ProxyStep grandchildren with a SendWait state carrying transSize.
 *   ring_harness LIB NCOLLS [proxyops] [steps] [rate_per_s] [pause]
 * rate_per_s > 0 paces the producer (events per second, busy-wait on CLOCK_MONOTONIC).
 * "pause": after init (the ring exists) print "READY" and wait for a line on stdin before the
 * events, so that a test can change the ring file in between.
 * Prints "EMITTED <records>" (the records the library should have written). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../include/nccl_abi.h"

static unsigned long long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

int main(int argc, char** argv) {
  if (argc < 3) { fprintf(stderr, "usage: %s LIB NCOLLS [proxyops] [steps] [rate] [pause]\n", argv[0]); return 2; }
  void* h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) { printf("FAIL dlopen: %s\n", dlerror()); return 1; }
  const ncclProfiler_v6_t* p = dlsym(h, "ncclProfiler_v6");
  if (!p) p = dlsym(h, "ncclProfiler_v5");
  if (!p) { printf("FAIL no ncclProfiler_v6/v5\n"); return 1; }
  long ncolls = atol(argv[2]);
  int nops = argc > 3 ? atoi(argv[3]) : 2, nsteps = argc > 4 ? atoi(argv[4]) : 4;
  double rate = argc > 5 ? atof(argv[5]) : 0;
  void* ctx = NULL;
  int mask = 0;
  if (p->init(&ctx, 0xc0ffee, &mask, "harness", 2, 2, 0, NULL) != ncclSuccess) { printf("FAIL init\n"); return 1; }
  if (mask == 0) { printf("FAIL profiler asked for no events (is NETWEAVE_PROF_RING set?)\n"); return 1; }
  if (argc > 6 && strcmp(argv[6], "pause") == 0) {
    char line[16];
    printf("READY\n");
    fflush(stdout);
    if (fgets(line, sizeof(line), stdin) == NULL) { printf("FAIL no go-ahead on stdin\n"); return 1; }
  }
  unsigned long long t0 = now_ns(), emitted = 0;
  for (long c = 0; c < ncolls; c++) {
    ncclProfilerEventDescr_t d;
    memset(&d, 0, sizeof(d));
    d.type = ncclProfileColl;
    d.coll.seqNumber = (uint64_t)c;
    d.coll.func = "AllReduce";
    d.coll.count = 1024 + (size_t)c;
    d.coll.datatype = "ncclFloat32";
    d.coll.algo = "RING";
    d.coll.proto = "SIMPLE";
    d.coll.nChannels = 2;
    void* coll = NULL;
    p->startEvent(ctx, &coll, &d);
    emitted++;
    for (int o = 0; o < nops; o++) {
      ncclProfilerEventDescr_t od;
      memset(&od, 0, sizeof(od));
      od.type = ncclProfileProxyOp;
      od.parentObj = coll;
      od.proxyOp.channelId = (uint8_t)o;
      od.proxyOp.peer = 1;
      od.proxyOp.nSteps = nsteps;
      od.proxyOp.chunkSize = 65536;
      od.proxyOp.isSend = o % 2 == 0;
      void* op = NULL;
      p->startEvent(ctx, &op, &od);
      emitted++;
      for (int s = 0; s < nsteps; s++) {
        ncclProfilerEventDescr_t sd;
        memset(&sd, 0, sizeof(sd));
        sd.type = ncclProfileProxyStep;
        sd.parentObj = op;
        sd.proxyStep.step = s;
        void* st = NULL;
        p->startEvent(ctx, &st, &sd);
        ncclProfilerEventStateArgs_t a;
        a.proxyStep.transSize = 65536 - (size_t)s;
        p->recordEventState(st, ncclProfilerProxyStepSendWait, &a);
        p->stopEvent(st);
        emitted += 3;
      }
      p->stopEvent(op);
      emitted++;
    }
    p->stopEvent(coll);
    emitted++;
    if (rate > 0)
      while ((double)(now_ns() - t0) * 1e-9 * rate < (double)emitted) { }
  }
  p->finalize(ctx);
  printf("EMITTED %llu in %.3f s\n", emitted, (double)(now_ns() - t0) * 1e-9);
  return 0;
}
