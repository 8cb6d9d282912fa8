/* netweave: what every role of the library shares: logging, the clock, the communicator
 * registry (net plugin -> tuner/profiler) and socket marking. */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

#include "nw.h"

/* ------------------------------------------------------------- logging -- */
ncclDebugLogger_t nw_logger = NULL;

void nw_log(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (nw_logger != NULL) {
    nw_logger(level, flags, file, line, "NET/netweave : %s", msg);
    return;
  }
  const char* dbg = getenv("NETWEAVE_DEBUG");
  if (level == NCCL_LOG_WARN || (dbg != NULL && dbg[0] != '\0' && dbg[0] != '0'))
    fprintf(stderr, "netweave %s:%d %s\n", file, line, msg);
}

/* --------------------------------------------------------------- clock -- */
uint64_t nw_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------- communicator registry -- */
#define NW_REGISTRY 1024
static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static struct { uint64_t id; int ncclClass, effClass; } reg[NW_REGISTRY];
static int reg_n = 0;

int nw_registry_note(uint64_t commId, int ncclClass, int effClass) {
  pthread_mutex_lock(&reg_lock);
  int order = -1;
  for (int i = 0; i < reg_n; i++)
    if (reg[i].id == commId) { order = i; break; }
  if (order < 0 && reg_n < NW_REGISTRY) {
    order = reg_n++;
    reg[order].id = commId;
  }
  if (order >= 0) {
    reg[order].ncclClass = ncclClass;
    reg[order].effClass = effClass;
  }
  pthread_mutex_unlock(&reg_lock);
  return order;
}

int nw_registry_lookup(uint64_t commId, int* order, int* ncclClass, int* effClass) {
  int found = -1;
  pthread_mutex_lock(&reg_lock);
  for (int i = 0; i < reg_n; i++)
    if (reg[i].id == commId) {
      found = i;
      if (order) *order = i;
      if (ncclClass) *ncclClass = reg[i].ncclClass;
      if (effClass) *effClass = reg[i].effClass;
      break;
    }
  pthread_mutex_unlock(&reg_lock);
  return found < 0 ? -1 : 0;
}

/* ------------------------------------------------------------- sockets -- */
int nw_sock_mark(int fd, int dscp, int prio, int64_t rate) {
  int rc = 0;
  if (dscp != NW_UNSET) {
    int tos = dscp << 2;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    int family = getsockname(fd, (struct sockaddr*)&ss, &sl) == 0 ? ss.ss_family : AF_INET;
    /* IPv4 (and v4-mapped traffic of a v6 socket) takes IP_TOS; native IPv6 takes IPV6_TCLASS */
    if (setsockopt(fd, IPPROTO_IP, IP_TOS, &tos, sizeof(tos)) != 0 && family == AF_INET) rc = -errno;
    if (family == AF_INET6 && setsockopt(fd, IPPROTO_IPV6, IPV6_TCLASS, &tos, sizeof(tos)) != 0) rc = -errno;
  }
  /* after IP_TOS, which rewrites sk_priority */
  if (prio != NW_UNSET && setsockopt(fd, SOL_SOCKET, SO_PRIORITY, &prio, sizeof(prio)) != 0) rc = -errno;
  if (rate != NW_UNSET) {
    uint64_t r = rate > 0 ? (uint64_t)rate : ~0ull; /* 0 = unlimited */
    if (setsockopt(fd, SOL_SOCKET, SO_MAX_PACING_RATE, &r, sizeof(r)) != 0) rc = -errno;
  }
  return rc;
}

