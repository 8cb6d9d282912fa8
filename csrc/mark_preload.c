/* netweave: LD_PRELOAD socket marker (libnetweave-mark.so) for processes that do not use
 * NCCL (gloo, TCPStore, iperf...). Every IPv4/IPv6 TCP socket that connect()s, listen()s or
 * is accept()ed gets IP_TOS (DSCP) and SO_PRIORITY; the SYN (marked before connect) and the
 * SYN-ACK (the listener is marked) carry the class too.
 *
 * Rules, most specific first:
 *   NETWEAVE_MARK_PORTS="29500:46:1,12345:8"  port:dscp[:prio]; the port is the peer's port
 *                                             for connect() and the local port for accept()
 *   plan file ($NETWEAVE_PLAN) lines "mark <port> dscp=D prio=P"
 *   NETWEAVE_DSCP / NETWEAVE_PRIORITY          every TCP socket
 *   plan file line "mark * dscp=D prio=P"
 * NETWEAVE_MARK_LOG=path appends one line per marked socket (for tests and debugging). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "nw.h"

typedef int (*connect_fn)(int, const struct sockaddr*, socklen_t);
typedef int (*accept_fn)(int, struct sockaddr*, socklen_t*);
typedef int (*accept4_fn)(int, struct sockaddr*, socklen_t*, int);
typedef int (*listen_fn)(int, int);

static connect_fn real_connect;
static accept_fn real_accept;
static accept4_fn real_accept4;
static listen_fn real_listen;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static nw_port_rule_t env_ports[NW_MAX_RULES];
static int n_env_ports = 0;
static int env_dscp = NW_UNSET, env_prio = NW_UNSET;

static int parse_small(const char* s, int lo, int hi, int* out) {
  char* end = NULL;
  long v = strtol(s, &end, 10);
  if (end == s || v < lo || v > hi) return -1;
  *out = (int)v;
  return 0;
}

static void setup(void) {
  real_connect = (connect_fn)dlsym(RTLD_NEXT, "connect");
  real_accept = (accept_fn)dlsym(RTLD_NEXT, "accept");
  real_accept4 = (accept4_fn)dlsym(RTLD_NEXT, "accept4");
  real_listen = (listen_fn)dlsym(RTLD_NEXT, "listen");
  const char* d = getenv("NETWEAVE_DSCP");
  if (d && d[0] && parse_small(d, 0, 63, &env_dscp) != 0) fprintf(stderr, "netweave-mark: NETWEAVE_DSCP=%s is not 0..63, ignored\n", d);
  const char* p = getenv("NETWEAVE_PRIORITY");
  if (p && p[0] && parse_small(p, 0, 0x7fffffff, &env_prio) != 0) fprintf(stderr, "netweave-mark: NETWEAVE_PRIORITY=%s is not a non-negative integer, ignored\n", p);
  const char* rules = getenv("NETWEAVE_MARK_PORTS");
  if (rules && rules[0]) {
    char buf[1024];
    snprintf(buf, sizeof(buf), "%s", rules);
    char* save = NULL;
    for (char* t = strtok_r(buf, ",", &save); t && n_env_ports < NW_MAX_RULES; t = strtok_r(NULL, ",", &save)) {
      nw_port_rule_t r = {NW_UNSET, NW_UNSET, NW_UNSET};
      char* f[3] = {t, NULL, NULL};
      for (int k = 1; k < 3 && f[k - 1]; k++) {
        char* c = strchr(f[k - 1], ':');
        if (c) { *c = '\0'; f[k] = c + 1; }
      }
      if (parse_small(f[0], 1, 65535, &r.port) != 0 || !f[1] || parse_small(f[1], 0, 63, &r.dscp) != 0 ||
          (f[2] && parse_small(f[2], 0, 0x7fffffff, &r.prio) != 0)) {
        fprintf(stderr, "netweave-mark: NETWEAVE_MARK_PORTS entry '%s' is not port:dscp[:prio], ignored\n", t);
        continue;
      }
      env_ports[n_env_ports++] = r;
    }
  }
}

static void choose(int port, int* dscp, int* prio) {
  *dscp = *prio = NW_UNSET;
  for (int i = 0; i < n_env_ports; i++)
    if (env_ports[i].port == port) { *dscp = env_ports[i].dscp; *prio = env_ports[i].prio; return; }
  const char* planfile = getenv("NETWEAVE_PLAN");
  nw_plan_t* plan = NULL;
  if (planfile && planfile[0] && (plan = malloc(sizeof(*plan))) != NULL) {
    nw_plan_snapshot(plan);
    for (int i = 0; i < plan->nport; i++)
      if (plan->port[i].port == port) { *dscp = plan->port[i].dscp; *prio = plan->port[i].prio; free(plan); return; }
  }
  if (env_dscp != NW_UNSET || env_prio != NW_UNSET) {
    *dscp = env_dscp;
    *prio = env_prio;
  } else if (plan != NULL) {
    for (int i = 0; i < plan->nport; i++)
      if (plan->port[i].port == NW_UNSET) { *dscp = plan->port[i].dscp; *prio = plan->port[i].prio; break; }
  }
  free(plan);
}

static int port_of(const struct sockaddr* sa) {
  if (sa == NULL) return -1;
  if (sa->sa_family == AF_INET) return ntohs(((const struct sockaddr_in*)sa)->sin_port);
  if (sa->sa_family == AF_INET6) return ntohs(((const struct sockaddr_in6*)sa)->sin6_port);
  return -1;
}


static void mark(int fd, int port, const char* how) {
  int type = 0;
  socklen_t tl = sizeof(type);
  struct sockaddr_storage ss;
  socklen_t sl = sizeof(ss);
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) != 0 || type != SOCK_STREAM) return;
  if (getsockname(fd, (struct sockaddr*)&ss, &sl) != 0 || (ss.ss_family != AF_INET && ss.ss_family != AF_INET6)) return;
  int dscp, prio;
  choose(port, &dscp, &prio);
  if (dscp == NW_UNSET && prio == NW_UNSET) return;
  int saved = errno;
  int rc = nw_sock_mark(fd, dscp, prio, NW_UNSET);
  const char* log = getenv("NETWEAVE_MARK_LOG");
  if (log && log[0]) {
    FILE* f = fopen(log, "a");
    if (f) {
      fprintf(f, "pid=%d fd=%d how=%s port=%d dscp=%d prio=%d rc=%d\n", (int)getpid(), fd, how, port, dscp, prio, rc);
      fclose(f);
    }
  }
  errno = saved;
}

NW_EXPORT int connect(int fd, const struct sockaddr* addr, socklen_t len) {
  pthread_once(&once, setup);
  if (addr != NULL && (addr->sa_family == AF_INET || addr->sa_family == AF_INET6)) mark(fd, port_of(addr), "connect");
  return real_connect(fd, addr, len);
}

static void mark_local(int fd, const char* how) {
  struct sockaddr_storage ss;
  socklen_t sl = sizeof(ss);
  if (getsockname(fd, (struct sockaddr*)&ss, &sl) == 0) mark(fd, port_of((struct sockaddr*)&ss), how);
}

static void mark_accepted(int fd) { mark_local(fd, "accept"); }

/* the SYN-ACK carries the listening socket's TOS, and accepted sockets inherit it */
NW_EXPORT int listen(int fd, int backlog) {
  pthread_once(&once, setup);
  mark_local(fd, "listen");
  return real_listen(fd, backlog);
}

NW_EXPORT int accept(int fd, struct sockaddr* addr, socklen_t* len) {
  pthread_once(&once, setup);
  int c = real_accept(fd, addr, len);
  if (c >= 0) mark_accepted(c);
  return c;
}

NW_EXPORT int accept4(int fd, struct sockaddr* addr, socklen_t* len, int flags) {
  pthread_once(&once, setup);
  int c = real_accept4(fd, addr, len, flags);
  if (c >= 0) mark_accepted(c);
  return c;
}
