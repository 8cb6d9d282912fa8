/* netweave test harness: loads a net plugin the way NCCL does (dlopen, then the newest
 * ncclNetPlugin_vN symbol it finds: v12 -> v11 -> v10, or the one forced with --version)
 * and drives its function table between two processes (fork): the child connects and
 * sends, the parent listens, accepts and receives. Checks every byte, the reported
 * sizes, receive buffers larger than the message, several requests in flight, grouped
 * receives (n > 1, matched by tag) and, with --oversize, that a message larger than the
 * posted buffer fails cleanly. Reports the marks (IP_TOS, SO_PRIORITY, SO_MAX_PACING_RATE)
 * of the plugin's TCP sockets as seen by getsockopt in each process.
 *
 *   net_harness LIB [--version auto|10|11|12] [--tc N] [--sizes a,b,c] [--iters N]
 *               [--window W] [--multi N] [--oversize] [--nocheck] [--rewrite-plan PATH]
 *               [--split recv|send --handle-file F]
 * Output: "VERSION n", "MARK role fd=.. tos=.. prio=.. pacing=..", then "OK ..." (exit 0)
 * or "FAIL ..." (exit 1). */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../include/nccl_abi.h"

#define MAXSIZES 64
#define MAXWIN 32

static int version = 0;
static const ncclNet_v10_t* n10;
static const ncclNet_v11_t* n11; /* v11 and v12 tables share every member we call except getProperties */
static const char* role = "?";

static void die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("FAIL %s: ", role);
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  fflush(stdout);
  exit(1);
}

static void logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)flags;
  if (level > NCCL_LOG_WARN && getenv("HARNESS_VERBOSE") == NULL) return;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "[%s %s:%d] ", role, file, line);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
}

#define CHECK(call) do { ncclResult_t _r = (call); if (_r != ncclSuccess) die("%s returned %d", #call, (int)_r); } while (0)

/* the same entry points, whatever the version */
#define T(fn) (version == 10 ? (void*)n10->fn : (void*)n11->fn)
typedef ncclResult_t (*isend_t)(void*, void*, size_t, int, void*, void*, void**);
typedef ncclResult_t (*irecv_t)(void*, int, void**, size_t*, int*, void**, void**, void**);
typedef ncclResult_t (*test_t)(void*, int*, int*);
typedef ncclResult_t (*close_t)(void*);
typedef ncclResult_t (*accept_t)(void*, void**, ncclNetDeviceHandle_t**);

static void load(const char* lib, const char* want) {
  void* h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) die("dlopen %s: %s", lib, dlerror());
  int order[3] = {12, 11, 10};
  for (int i = 0; i < 3 && version == 0; i++) {
    if (strcmp(want, "auto") != 0 && atoi(want) != order[i]) continue;
    char sym[32];
    snprintf(sym, sizeof(sym), "ncclNetPlugin_v%d", order[i]);
    void* p = dlsym(h, sym);
    if (p == NULL) continue;
    version = order[i];
    if (version == 10) n10 = p; else n11 = p;
  }
  if (version == 0) die("no ncclNetPlugin_v12/v11/v10 symbol in %s", lib);
}

static void* init_ctx(uint64_t commId, int tc) {
  ncclNetCommConfig_t cfg = {tc};
  void* ctx = NULL;
  if (version == 10) CHECK(n10->init(logger, NULL));
  else CHECK(n11->init(&ctx, commId, &cfg, logger, NULL));
  int ndev = 0;
  CHECK(version == 10 ? n10->devices(&ndev) : n11->devices(&ndev));
  if (ndev < 1) die("plugin reports %d devices", ndev);
  if (version == 12) {
    ncclNetProperties_v12_t p;
    CHECK(((const ncclNet_v12_t*)n11)->getProperties(0, &p));
    if (p.ptrSupport != NCCL_PTR_HOST || p.maxRecvs < 1 || p.vProps.ndevs != 1) die("unexpected v12 properties");
    printf("DEVICE %s speed=%d maxRecvs=%d\n", p.name, p.speed, p.maxRecvs);
  } else if (version == 11) {
    ncclNetProperties_v11_t p;
    CHECK(n11->getProperties(0, &p));
    printf("DEVICE %s speed=%d maxRecvs=%d\n", p.name, p.speed, p.maxRecvs);
  } else {
    ncclNetProperties_v10_t p;
    CHECK(n10->getProperties(0, &p));
    printf("DEVICE %s speed=%d maxRecvs=%d\n", p.name, p.speed, p.maxRecvs);
  }
  return ctx;
}

static void report_marks(const char* label) {
  DIR* d = opendir("/proc/self/fd");
  if (d == NULL) return;
  struct dirent* e;
  while ((e = readdir(d)) != NULL) {
    int fd = atoi(e->d_name);
    if (e->d_name[0] == '.' || fd == dirfd(d)) continue;
    int type = 0, tos = 0, prio = 0;
    uint64_t pacing = 0;
    socklen_t l = sizeof(type);
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &l) != 0 || type != SOCK_STREAM) continue;
    struct sockaddr_storage peer;
    socklen_t pl = sizeof(peer);
    if (getpeername(fd, (struct sockaddr*)&peer, &pl) != 0) continue; /* listening sockets */
    l = sizeof(tos);
    getsockopt(fd, IPPROTO_IP, IP_TOS, &tos, &l);
    l = sizeof(prio);
    getsockopt(fd, SOL_SOCKET, SO_PRIORITY, &prio, &l);
    l = sizeof(pacing);
    getsockopt(fd, SOL_SOCKET, SO_MAX_PACING_RATE, &pacing, &l);
    struct sockaddr_storage self;
    socklen_t sl = sizeof(self);
    getsockname(fd, (struct sockaddr*)&self, &sl);
    int lport = self.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6*)&self)->sin6_port) : ntohs(((struct sockaddr_in*)&self)->sin_port);
    int rport = peer.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6*)&peer)->sin6_port) : ntohs(((struct sockaddr_in*)&peer)->sin_port);
    printf("%s %s fd=%d tos=%d prio=%d pacing=%llu lport=%d rport=%d\n", label, role, fd, tos, prio, (unsigned long long)pacing, lport, rport);
  }
  closedir(d);
  fflush(stdout);
}

static unsigned char pattern(size_t i, size_t size, int iter) { return (unsigned char)((i * 131u) ^ (size * 7u) ^ ((unsigned)iter * 29u) ^ (i >> 11)); }

static void wait_req(void* req, int* sizes) {
  int done = 0;
  while (!done) CHECK(((test_t)T(test))(req, &done, sizes));
}

static size_t sizes[MAXSIZES];
static int nsizes = 0;
static int nocheck = 0; /* --nocheck: benchmark mode, no fill/verify loops */
static const char* rewrite_plan = NULL; /* --rewrite-plan PATH: after iteration 0 the sender writes $HARNESS_NEW_PLAN there */

static void do_rewrite_plan(void) {
  const char* text = getenv("HARNESS_NEW_PLAN");
  char tmp[600];
  snprintf(tmp, sizeof(tmp), "%s.tmp", rewrite_plan);
  FILE* f = fopen(tmp, "w");
  if (f == NULL || text == NULL) die("cannot rewrite the plan");
  fputs(text, f);
  fclose(f);
  if (rename(tmp, rewrite_plan) != 0) die("rename plan");
  usleep(150000); /* the library looks at the plan file at most every 100 ms */
}

static void run_sender(void* comm, int iters, int window, int multi, int oversize) {
  isend_t isend = (isend_t)T(isend);
  size_t maxs = 1;
  for (int i = 0; i < nsizes; i++) maxs = sizes[i] > maxs ? sizes[i] : maxs;
  unsigned char* bufs[MAXWIN];
  for (int w = 0; w < window; w++) if (!(bufs[w] = malloc(maxs))) die("malloc");
  for (int it = 0; it < iters; it++)
    for (int si = 0; si < nsizes; si++) {
      if (rewrite_plan && it == 1 && si == 0) do_rewrite_plan();
      size_t size = sizes[si];
      void* reqs[MAXWIN];
      int n = multi > 1 ? multi : window;
      for (int w = 0; w < n; w++) {
        /* grouped receives: send the tags in reverse so matching by tag is exercised */
        int tag = multi > 1 ? (multi - 1 - w) : w;
        if (!nocheck)
          for (size_t i = 0; i < size; i++) bufs[w][i] = pattern(i, size, it * 100 + tag);
        reqs[w] = NULL;
        while (reqs[w] == NULL) CHECK(isend(comm, bufs[w], size, tag, NULL, NULL, &reqs[w]));
      }
      for (int w = 0; w < n; w++) {
        int got = -1;
        if (oversize && si == nsizes - 1) {
          /* the receiver rejects this one and closes: the send must end in an error, not hang */
          int done = 0;
          ncclResult_t r = ncclSuccess;
          while (!done && r == ncclSuccess) r = ((test_t)T(test))(reqs[w], &done, &got);
          printf("SENDER last send %s (%d)\n", r == ncclSuccess ? "completed" : "failed", (int)r);
          return;
        }
        wait_req(reqs[w], &got);
        if ((size_t)got != size) die("send test reported %d bytes, sent %zu", got, size);
      }
    }
  for (int w = 0; w < window; w++) free(bufs[w]);
}

static long long run_receiver(void* comm, int iters, int window, int multi, int oversize) {
  irecv_t irecv = (irecv_t)T(irecv);
  size_t maxs = 1;
  long long total = 0;
  for (int i = 0; i < nsizes; i++) maxs = sizes[i] > maxs ? sizes[i] : maxs;
  size_t slack = 4096; /* buffers larger than the message */
  unsigned char* bufs[MAXWIN];
  for (int w = 0; w < window; w++) if (!(bufs[w] = malloc(maxs + slack))) die("malloc");
  for (int it = 0; it < iters; it++)
    for (int si = 0; si < nsizes; si++) {
      size_t size = sizes[si];
      if (oversize && si == nsizes - 1) {
        /* the last message is larger than the posted buffer: irecv + test must fail, not crash */
        void* data[1] = {bufs[0]};
        size_t cap[1] = {size / 2};
        int tag[1] = {0};
        void* req = NULL;
        while (req == NULL) CHECK(irecv(comm, 1, data, cap, tag, NULL, NULL, &req));
        int done = 0;
        ncclResult_t r = ncclSuccess;
        while (!done && r == ncclSuccess) r = ((test_t)T(test))(req, &done, NULL);
        if (r == ncclSuccess) die("oversize message was accepted into a %zu-byte buffer", cap[0]);
        printf("OVERSIZE rejected with %d\n", (int)r);
        fflush(stdout);
        CHECK(((close_t)T(closeRecv))(comm));
        for (int w = 0; w < window; w++) free(bufs[w]);
        return -1 - total;
      }
      if (multi > 1) {
        void* data[MAXWIN];
        size_t cap[MAXWIN];
        int tags[MAXWIN], got[MAXWIN];
        for (int k = 0; k < multi; k++) { data[k] = bufs[k]; cap[k] = maxs + slack; tags[k] = k; got[k] = -1; }
        void* req = NULL;
        while (req == NULL) CHECK(irecv(comm, multi, data, cap, tags, NULL, NULL, &req));
        wait_req(req, got);
        for (int k = 0; k < multi; k++) {
          if ((size_t)got[k] != size) die("grouped recv slot %d got %d bytes, expected %zu", k, got[k], size);
          for (size_t i = 0; i < size; i++)
            if (bufs[k][i] != pattern(i, size, it * 100 + k)) die("grouped recv slot %d byte %zu of %zu corrupt", k, i, size);
          total += (long long)size;
        }
        continue;
      }
      void* reqs[MAXWIN];
      for (int w = 0; w < window; w++) {
        void* data[1] = {bufs[w]};
        size_t cap[1] = {maxs + slack};
        int tag[1] = {w};
        reqs[w] = NULL;
        while (reqs[w] == NULL) CHECK(irecv(comm, 1, data, cap, tag, NULL, NULL, &reqs[w]));
      }
      for (int w = 0; w < window; w++) {
        int got = -1;
        wait_req(reqs[w], &got);
        if ((size_t)got != size) die("recv test reported %d bytes, expected %zu", got, size);
        for (size_t i = 0; i < size && !nocheck; i++)
          if (bufs[w][i] != pattern(i, size, it * 100 + w)) die("byte %zu of a %zu-byte message corrupt (window %d)", i, size, w);
        total += (long long)size;
      }
    }
  for (int w = 0; w < window; w++) free(bufs[w]);
  return total;
}

/* --split recv|send --handle-file F: one end per process (e.g. in two network namespaces); the
 * receiver publishes its handle in F (write + rename), the sender waits for F. */
static int run_split(const char* which, const char* handle_file, int tc, int iters, int window, int multi) {
  if (handle_file == NULL) die("--split needs --handle-file");
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  memset(handle, 0, sizeof(handle));
  if (!strcmp(which, "recv")) {
    role = "receiver";
    void* ctx = init_ctx(0x7ec5, tc);
    void* lcomm = NULL;
    CHECK(version == 10 ? n10->listen(0, handle, &lcomm) : n11->listen(ctx, 0, handle, &lcomm));
    char tmp[600];
    snprintf(tmp, sizeof(tmp), "%s.tmp", handle_file);
    FILE* f = fopen(tmp, "wb");
    if (f == NULL || fwrite(handle, 1, sizeof(handle), f) != sizeof(handle)) die("cannot write %s", tmp);
    fclose(f);
    if (rename(tmp, handle_file) != 0) die("rename %s", tmp);
    void* comm = NULL;
    while (comm == NULL) CHECK(((accept_t)T(accept))(lcomm, &comm, NULL));
    report_marks("MARK");
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long long total = run_receiver(comm, iters, window, multi, 0);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("TIME %.6f\n", (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    CHECK(((close_t)T(closeRecv))(comm));
    CHECK(((close_t)T(closeListen))(lcomm));
    if (version != 10) CHECK(n11->finalize(ctx));
    printf("OK receiver bytes=%lld version=%d\n", total, version);
    return 0;
  }
  if (strcmp(which, "send") != 0) die("--split takes recv or send");
  role = "sender";
  void* ctx = init_ctx(0x5e4d, tc);
  for (int tries = 0;; tries++) {
    FILE* f = fopen(handle_file, "rb");
    if (f != NULL) {
      size_t got = fread(handle, 1, sizeof(handle), f);
      fclose(f);
      if (got == sizeof(handle)) break;
    }
    if (tries > 6000) die("no handle in %s after 60 s", handle_file);
    usleep(10000);
  }
  void* comm = NULL;
  while (comm == NULL) {
    if (version == 10) { ncclNetCommConfig_t cfg = {tc}; CHECK(n10->connect(0, &cfg, handle, &comm, NULL)); }
    else CHECK(n11->connect(ctx, 0, handle, &comm, NULL));
  }
  report_marks("MARK");
  run_sender(comm, iters, window, multi, 0);
  CHECK(((close_t)T(closeSend))(comm)); /* graceful: queued bytes still reach the receiver */
  if (version != 10) CHECK(n11->finalize(ctx));
  printf("OK sender\n");
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) { fprintf(stderr, "usage: %s LIB [options]\n", argv[0]); return 2; }
  const char* want = "auto";
  const char *split = NULL, *handle_file = NULL;
  int tc = NCCL_NET_TRAFFIC_CLASS_UNDEF, iters = 2, window = 4, multi = 1, oversize = 0;
  const char* sizelist = "0,1,7,4096,65535,65536,131071,131072,131073,262145,1000000,4194304,16777219";
  for (int i = 2; i < argc; i++) {
    if (!strcmp(argv[i], "--version") && i + 1 < argc) want = argv[++i];
    else if (!strcmp(argv[i], "--tc") && i + 1 < argc) tc = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--sizes") && i + 1 < argc) sizelist = argv[++i];
    else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--window") && i + 1 < argc) window = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--multi") && i + 1 < argc) multi = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--oversize")) oversize = 1;
    else if (!strcmp(argv[i], "--nocheck")) nocheck = 1;
    else if (!strcmp(argv[i], "--rewrite-plan") && i + 1 < argc) rewrite_plan = argv[++i];
    else if (!strcmp(argv[i], "--split") && i + 1 < argc) split = argv[++i];
    else if (!strcmp(argv[i], "--handle-file") && i + 1 < argc) handle_file = argv[++i];
    else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
  }
  if (window < 1 || window > MAXWIN || multi < 1 || multi > 8) { fprintf(stderr, "window 1..32, multi 1..8\n"); return 2; }
  if (multi > 1 && window < multi) window = multi;
  char buf[1024];
  snprintf(buf, sizeof(buf), "%s", sizelist);
  for (char* t = strtok(buf, ","); t && nsizes < MAXSIZES; t = strtok(NULL, ",")) sizes[nsizes++] = strtoull(t, NULL, 0);
  load(argv[1], want);
  printf("VERSION %d\n", version);
  fflush(stdout);
  if (split != NULL) return run_split(split, handle_file, tc, iters, window, multi);

  int pipefd[2], backfd[2];
  if (pipe(pipefd) != 0 || pipe(backfd) != 0) die("pipe");
  pid_t child = fork();
  if (child < 0) die("fork");
  if (child == 0) {
    role = "sender";
    close(pipefd[1]);
    close(backfd[1]);
    void* ctx = init_ctx(0x5e4d, tc);
    char handle[NCCL_NET_HANDLE_MAXSIZE];
    if (read(pipefd[0], handle, sizeof(handle)) != (ssize_t)sizeof(handle)) die("handle read");
    void* comm = NULL;
    while (comm == NULL) {
      if (version == 10) { ncclNetCommConfig_t cfg = {tc}; CHECK(n10->connect(0, &cfg, handle, &comm, NULL)); }
      else CHECK(n11->connect(ctx, 0, handle, &comm, NULL));
    }
    report_marks("MARK");
    run_sender(comm, iters, window, multi, oversize);
    /* wait for the receiver to finish before closing (the last bytes may still be in flight) */
    report_marks("MARKEND");
    char ack;
    if (read(backfd[0], &ack, 1) != 1) die("ack read");
    CHECK(((close_t)T(closeSend))(comm));
    if (version != 10) CHECK(n11->finalize(ctx));
    printf("OK sender\n");
    fflush(stdout);
    _exit(0);
  }
  role = "receiver";
  close(pipefd[0]);
  close(backfd[0]);
  void* ctx = init_ctx(0x7ec5, tc);
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  memset(handle, 0, sizeof(handle));
  void* lcomm = NULL;
  CHECK(version == 10 ? n10->listen(0, handle, &lcomm) : n11->listen(ctx, 0, handle, &lcomm));
  if (write(pipefd[1], handle, sizeof(handle)) != (ssize_t)sizeof(handle)) die("handle write");
  void* comm = NULL;
  while (comm == NULL) CHECK(((accept_t)T(accept))(lcomm, &comm, NULL));
  report_marks("MARK");
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  long long total = run_receiver(comm, iters, window, multi, oversize);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  printf("TIME %.6f\n", (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
  if (write(backfd[1], "k", 1) != 1) die("ack write");
  int status = 0;
  waitpid(child, &status, 0);
  if (total >= 0) CHECK(((close_t)T(closeRecv))(comm));
  else total = -1 - total;
  CHECK(((close_t)T(closeListen))(lcomm));
  if (version != 10) CHECK(n11->finalize(ctx));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) die("sender exited with status %d", status);
  printf("OK receiver bytes=%lld version=%d\n", total, version);
  return 0;
}
