/* netweave: NCCL network plugin (ncclNetPlugin_v12, v11, v10) over host TCP sockets.
 *
 * One connection = 1 control socket + N data sockets (plan `nsocks`, env NETWEAVE_NSOCKS,
 * default 2). Each message sends a 16-byte header {magic, tag, size} on the control socket;
 * its payload is cut into stripes of `sockchunk` bytes (default 128 KiB) dealt round-robin
 * over the data sockets (stripe i on socket i % N). Every socket carries its share of the
 * messages in posting order, so both ends compute the same layout from the header alone.
 * All I/O is non-blocking; progress happens in test(). Every socket of a communicator is
 * marked with the DSCP / SO_PRIORITY / pacing rate resolved from NCCL's traffic class and
 * the flow plan (nw_plan_resolve); the marking is re-applied when the plan file changes.
 *
 * Supported: host memory only (NCCL_PTR_HOST), sizes 0 .. 1 GiB, receive buffers larger
 * than the message (test reports the received size), grouped receives with n <= 8 (tags
 * matched per message; advertised through maxRecvs only when NETWEAVE_MAX_RECVS > 1, NCCL's
 * default 1 is what its own socket transport offers), up to 32 requests in flight per comm.
 * Not supported: CUDA/DMA-BUF registration, iflush (never needed with host buffers),
 * device offload, virtual NIC merging (makeVDevice NULL). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include "nw.h"

#define NW_MAX_DEVS 16
#define NW_MAX_SOCKS 16
#define NW_MAX_RECVS 8
#define NW_MSG_RING (NCCL_NET_MAX_REQUESTS * NW_MAX_RECVS)
#define NW_MAX_MSG_BYTES (1ull << 30)
#define NW_HANDLE_MAGIC 0x4e574831u /* "NWH1" */
#define NW_HELLO_MAGIC 0x4e574831u
#define NW_HDR_MAGIC 0x4e574d31u
#define NW_VERSION 1

typedef union {
  struct sockaddr sa;
  struct sockaddr_in in4;
  struct sockaddr_in6 in6;
} nw_addr_t;

typedef struct {
  char name[IF_NAMESIZE];
  nw_addr_t addr;
  char* pciPath;
  int speed;
} nw_dev_t;

static nw_dev_t devs[NW_MAX_DEVS];
static int ndevs = 0;
static pthread_once_t devs_once = PTHREAD_ONCE_INIT;

/* What travels in NCCL's 128-byte handle. `stage` is local to the connecting process: NCCL
 * hands the same handle back on every connect() retry, so the in-progress state lives there. */
typedef struct {
  uint32_t magic;
  uint16_t version;
  uint16_t pad;
  uint64_t nonce;
  nw_addr_t addr;
  void* stage;
} nw_handle_t;
_Static_assert(sizeof(nw_handle_t) <= NCCL_NET_HANDLE_MAXSIZE, "handle fits NCCL's 128 bytes");

typedef struct {
  uint32_t magic;
  uint16_t version;
  uint16_t index;  /* 0 = control, 1..nsocks = data */
  uint16_t nsocks; /* data sockets */
  int16_t dscp;
  int32_t prio;
  uint32_t sockchunk;
  uint32_t pad;
  uint64_t conn_id;
  uint64_t nonce;
} nw_hello_t;

typedef struct {
  uint32_t magic;
  int32_t tag;
  uint64_t size;
} nw_hdr_t;

typedef struct {
  uint64_t commId;
  int ncclClass;
  int order;
  nw_mark_t mark;
  ncclNetAttr_t attr;
} nw_ctx_t;

struct nw_comm;
typedef struct nw_req {
  int used;
  struct nw_comm* comm;
  int is_send;
  int n;
  uint64_t first; /* message sequence numbers first .. first + n - 1 */
  void* data[NW_MAX_RECVS];
  size_t cap[NW_MAX_RECVS];
  int tags[NW_MAX_RECVS];
  int taken[NW_MAX_RECVS];
  uint64_t got[NW_MAX_RECVS];
} nw_req_t;

typedef struct {
  int used;
  nw_req_t* req;
  char* data;
  uint64_t size;
  uint32_t hdr_off;
  nw_hdr_t hdr;
  uint64_t done[NW_MAX_SOCKS];
} nw_msg_t;

typedef struct nw_comm {
  int is_send;
  int nsocks;
  int ctrl;
  int fds[NW_MAX_SOCKS];
  uint64_t sockchunk;
  int failed; /* sticky ncclResult_t once a socket broke */
  uint64_t tail, ctrl_seq, sock_seq[NW_MAX_SOCKS];
  uint64_t commId;
  int ncclClass, order, dscp, prio;
  int64_t rate;
  uint64_t plan_gen;
  nw_req_t reqs[NCCL_NET_MAX_REQUESTS];
  nw_msg_t msgs[NW_MSG_RING];
} nw_comm_t;

typedef struct {
  int fd;
  nw_hello_t hello;
  uint32_t off;
} nw_pending_t;

typedef struct {
  uint64_t conn_id;
  int nsocks;
  int have;
  nw_hello_t hello;
  int fds[NW_MAX_SOCKS + 1];
} nw_group_t;

#define NW_MAX_PENDING 64
typedef struct {
  int fd;
  uint64_t nonce;
  nw_pending_t pending[NW_MAX_PENDING];
  int npending;
  nw_group_t groups[8];
  int ngroups;
} nw_listen_t;

typedef struct {
  int nsocks;
  int fds[NW_MAX_SOCKS + 1];
  int state[NW_MAX_SOCKS + 1]; /* 0 connecting, 1 sending hello, 2 ready */
  uint32_t off[NW_MAX_SOCKS + 1];
  nw_hello_t hello;
  nw_mark_t mark;
  uint64_t commId;
  int ncclClass, order;
} nw_stage_t;

/* ------------------------------------------------------------- helpers -- */
static int env_int(const char* name, int dflt, int lo, int hi) {
  const char* v = getenv(name);
  if (v == NULL || v[0] == '\0') return dflt;
  long x = strtol(v, NULL, 0);
  return x < lo ? lo : x > hi ? hi : (int)x;
}

static uint64_t random_u64(void) {
  static uint64_t counter = 0;
  uint64_t r = 0;
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    if (read(fd, &r, sizeof(r)) != (ssize_t)sizeof(r)) r = 0;
    close(fd);
  }
  return r ^ nw_now_ns() ^ ((uint64_t)getpid() << 32) ^ __atomic_add_fetch(&counter, 0x9e3779b97f4a7c15ull, __ATOMIC_RELAXED);
}

static int set_nonblock(int fd) {
  int fl = fcntl(fd, F_GETFL);
  return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

static socklen_t addr_len(const nw_addr_t* a) { return a->sa.sa_family == AF_INET6 ? sizeof(a->in6) : sizeof(a->in4); }

static int if_selected(const char* name, int loopback) {
  const char* spec = getenv("NETWEAVE_SOCKET_IFNAME");
  if (spec == NULL || spec[0] == '\0') spec = getenv("NCCL_SOCKET_IFNAME");
  if (spec == NULL || spec[0] == '\0') return !loopback && strncmp(name, "docker", 6) != 0;
  int exclude = spec[0] == '^';
  if (exclude) spec++;
  int exact = spec[0] == '=';
  if (exact) spec++;
  char buf[256];
  snprintf(buf, sizeof(buf), "%s", spec);
  int hit = 0;
  char* save = NULL;
  for (char* t = strtok_r(buf, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save))
    if (exact ? strcmp(name, t) == 0 : strncmp(name, t, strlen(t)) == 0) hit = 1;
  return exclude ? !hit : hit;
}

static void add_dev(const char* name, const struct sockaddr* sa) {
  for (int i = 0; i < ndevs; i++)
    if (strcmp(devs[i].name, name) == 0) return;
  if (ndevs == NW_MAX_DEVS) return;
  nw_dev_t* d = &devs[ndevs++];
  snprintf(d->name, sizeof(d->name), "%s", name);
  memset(&d->addr, 0, sizeof(d->addr));
  memcpy(&d->addr, sa, sa->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in));
  char path[PATH_MAX], real[PATH_MAX];
  snprintf(path, sizeof(path), "/sys/class/net/%s/device", name);
  d->pciPath = realpath(path, real) ? strdup(real) : NULL;
  snprintf(path, sizeof(path), "/sys/class/net/%s/speed", name);
  d->speed = 10000;
  FILE* f = fopen(path, "r");
  if (f != NULL) {
    int s = 0;
    if (fscanf(f, "%d", &s) == 1 && s > 0) d->speed = s;
    fclose(f);
  }
}

static void discover_devs(void) {
  struct ifaddrs* ifs = NULL;
  if (getifaddrs(&ifs) != 0) return;
  int want6 = env_int("NETWEAVE_SOCKET_FAMILY", 4, 4, 6) == 6;
  for (int pass = 0; pass < 2 && ndevs == 0; pass++) /* pass 1: loopback when nothing else qualifies */
    for (struct ifaddrs* i = ifs; i != NULL; i = i->ifa_next) {
      if (i->ifa_addr == NULL || !(i->ifa_flags & IFF_UP)) continue;
      if (i->ifa_addr->sa_family != (want6 ? AF_INET6 : AF_INET)) continue;
      int lo = (i->ifa_flags & IFF_LOOPBACK) != 0;
      if (pass == 0 ? !if_selected(i->ifa_name, lo) : !lo) continue;
      if (want6 && IN6_IS_ADDR_LINKLOCAL(&((struct sockaddr_in6*)i->ifa_addr)->sin6_addr)) continue;
      add_dev(i->ifa_name, i->ifa_addr);
    }
  freeifaddrs(ifs);
  for (int i = 0; i < ndevs; i++) NW_INFO(NCCL_INIT | NCCL_NET, "device %d: %s (%d Mbps)", i, devs[i].name, devs[i].speed);
}

static ncclResult_t ensure_devs(void) {
  pthread_once(&devs_once, discover_devs);
  if (ndevs == 0) {
    NW_WARN("no usable network interface (check NETWEAVE_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)");
    return ncclSystemError;
  }
  return ncclSuccess;
}

/* stripe layout: bytes of a size-byte message that travel on data socket s */
static uint64_t portion(uint64_t size, uint64_t chunk, int n, int s) {
  uint64_t full = size / chunk, rem = size % chunk;
  uint64_t b = (full / (uint64_t)n + ((uint64_t)s < full % (uint64_t)n ? 1 : 0)) * chunk;
  if (rem > 0 && full % (uint64_t)n == (uint64_t)s) b += rem;
  return b;
}

static void mark_comm_sockets(nw_comm_t* c) {
  int64_t per_sock = c->rate > 0 ? c->rate / c->nsocks : c->rate;
  if (c->rate > 0 && per_sock == 0) per_sock = 1;
  nw_sock_mark(c->ctrl, c->dscp, c->prio, NW_UNSET);
  for (int s = 0; s < c->nsocks; s++) {
    int rc = nw_sock_mark(c->fds[s], c->dscp, c->prio, c->is_send ? per_sock : NW_UNSET);
    if (rc != 0) NW_WARN("marking socket (dscp %d prio %d rate %ld) failed: %s", c->dscp, c->prio, (long)per_sock, strerror(-rc));
  }
}

/* re-resolve the marking when the plan file changed (send side: it owns the connection's class) */
static void refresh_marks(nw_comm_t* c) {
  uint64_t gen = nw_plan_snapshot(NULL);
  if (gen == c->plan_gen || !c->is_send) return;
  c->plan_gen = gen;
  nw_plan_t* plan = malloc(sizeof(*plan));
  if (plan == NULL) return;
  nw_plan_snapshot(plan);
  nw_mark_t m;
  nw_plan_resolve(plan, c->commId, c->order, c->ncclClass, &m);
  free(plan);
  if (m.dscp != c->dscp || m.prio != c->prio || m.rate != c->rate) {
    c->dscp = m.dscp;
    c->prio = m.prio;
    c->rate = m.rate;
    mark_comm_sockets(c);
    NW_INFO(NCCL_NET, "comm %lx re-marked: dscp %d prio %d rate %ld", (unsigned long)c->commId, c->dscp, c->prio, (long)c->rate);
  }
}

/* ------------------------------------------------------ init / devices -- */
static ncclResult_t nw_ctx_new(void** ctx, uint64_t commId, int ncclClass) {
  nw_ctx_t* x = calloc(1, sizeof(*x));
  if (x == NULL) return ncclSystemError;
  x->commId = commId;
  x->ncclClass = ncclClass;
  x->order = nw_registry_note(commId, ncclClass, -1);
  nw_plan_t* plan = malloc(sizeof(*plan));
  if (plan == NULL) { free(x); return ncclSystemError; }
  nw_plan_snapshot(plan);
  nw_plan_resolve(plan, commId, x->order, ncclClass, &x->mark);
  free(plan);
  nw_registry_note(commId, ncclClass, x->mark.cls);
  x->attr.op = x->attr.algo = x->attr.proto = (uint32_t)-1;
  NW_INFO(NCCL_INIT | NCCL_NET, "comm %lx (order %d) trafficClass %d -> class %d dscp %d prio %d rate %ld nsocks %d",
          (unsigned long)commId, x->order, ncclClass, x->mark.cls, x->mark.dscp, x->mark.prio, (long)x->mark.rate, x->mark.nsocks);
  *ctx = x;
  return ncclSuccess;
}

static ncclResult_t net_init_v11(void** ctx, uint64_t commId, ncclNetCommConfig_t* config, ncclDebugLogger_t logFunction,
                                 ncclProfilerCallback_t profFunction) {
  (void)profFunction;
  if (logFunction != NULL) nw_logger = logFunction;
  ncclResult_t r = ensure_devs();
  if (r != ncclSuccess) return r;
  nw_ring_get();
  return nw_ctx_new(ctx, commId, config ? config->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF);
}

static ncclResult_t net_init_v10(ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction) {
  (void)profFunction;
  if (logFunction != NULL) nw_logger = logFunction;
  nw_ring_get();
  return ensure_devs();
}

static ncclResult_t net_finalize(void* ctx) {
  free(ctx);
  return ncclSuccess;
}

static ncclResult_t net_set_attr(void* ctx, ncclNetAttr_t* attr) {
  if (ctx != NULL && attr != NULL) ((nw_ctx_t*)ctx)->attr = *attr;
  return ncclSuccess;
}

static ncclResult_t net_devices(int* ndev) {
  ncclResult_t r = ensure_devs();
  *ndev = ndevs;
  return r;
}

#define FILL_PROPS(props, dev)                                              \
  do {                                                                      \
    if ((dev) < 0 || (dev) >= ndevs) return ncclInvalidArgument;            \
    memset((props), 0, sizeof(*(props)));                                   \
    (props)->name = devs[dev].name;                                         \
    (props)->pciPath = devs[dev].pciPath;                                   \
    (props)->guid = (uint64_t)(dev);                                        \
    (props)->ptrSupport = NCCL_PTR_HOST;                                    \
    (props)->regIsGlobal = 0;                                               \
    (props)->forceFlush = 0;                                                \
    (props)->speed = devs[dev].speed;                                       \
    (props)->port = 0;                                                      \
    (props)->latency = 0;                                                   \
    (props)->maxComms = 65536;                                              \
    (props)->maxRecvs = env_int("NETWEAVE_MAX_RECVS", 1, 1, NW_MAX_RECVS);  \
    (props)->netDeviceType = NCCL_NET_DEVICE_HOST;                          \
    (props)->netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION;            \
    (props)->vProps.ndevs = 1;                                              \
    (props)->vProps.devs[0] = (dev);                                        \
    (props)->maxP2pBytes = NW_MAX_MSG_BYTES;                                \
    (props)->maxCollBytes = NW_MAX_MSG_BYTES;                               \
  } while (0)

static ncclResult_t net_props_v10(int dev, ncclNetProperties_v10_t* p) {
  ncclResult_t r = ensure_devs();
  if (r != ncclSuccess) return r;
  FILL_PROPS(p, dev);
  return ncclSuccess;
}
static ncclResult_t net_props_v11(int dev, ncclNetProperties_v11_t* p) {
  ncclResult_t r = ensure_devs();
  if (r != ncclSuccess) return r;
  FILL_PROPS(p, dev);
  p->maxMultiRequestSize = 1;
  return ncclSuccess;
}
static ncclResult_t net_props_v12(int dev, ncclNetProperties_v12_t* p) {
  ncclResult_t r = ensure_devs();
  if (r != ncclSuccess) return r;
  FILL_PROPS(p, dev);
  p->maxMultiRequestSize = 1;
  p->railId = NCCL_NET_ID_UNDEF;
  p->planeId = NCCL_NET_ID_UNDEF;
  return ncclSuccess;
}

/* ---------------------------------------------------------- listen/accept -- */
static ncclResult_t net_listen_v11(void* ctx, int dev, void* opaque, void** listenComm) {
  *listenComm = NULL;
  ncclResult_t r = ensure_devs();
  if (r != ncclSuccess) return r;
  if (dev < 0 || dev >= ndevs) return ncclInvalidArgument;
  nw_handle_t* h = opaque;
  memset(h, 0, sizeof(*h));
  nw_addr_t a = devs[dev].addr;
  if (a.sa.sa_family == AF_INET) a.in4.sin_port = 0; else a.in6.sin6_port = 0;
  int fd = socket(a.sa.sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) { NW_WARN("socket: %s", strerror(errno)); return ncclSystemError; }
  /* accepted sockets inherit the listener's TOS and the SYN-ACK carries it: mark the listener with
   * this communicator's class (v11+; v10's listen has no communicator, its accepted sockets are
   * marked from the sender's handshake) */
  if (ctx != NULL) nw_sock_mark(fd, ((nw_ctx_t*)ctx)->mark.dscp, ((nw_ctx_t*)ctx)->mark.prio, NW_UNSET);
  if (bind(fd, &a.sa, addr_len(&a)) != 0 || listen(fd, 1024) != 0 || set_nonblock(fd) != 0) {
    NW_WARN("listen on %s: %s", devs[dev].name, strerror(errno));
    close(fd);
    return ncclSystemError;
  }
  socklen_t sl = sizeof(h->addr);
  if (getsockname(fd, &h->addr.sa, &sl) != 0) { close(fd); return ncclSystemError; }
  nw_listen_t* l = calloc(1, sizeof(*l));
  if (l == NULL) { close(fd); return ncclSystemError; }
  l->fd = fd;
  l->nonce = random_u64();
  h->magic = NW_HANDLE_MAGIC;
  h->version = NW_VERSION;
  h->nonce = l->nonce;
  h->stage = NULL;
  *listenComm = l;
  return ncclSuccess;
}

static ncclResult_t net_listen_v10(int dev, void* handle, void** listenComm) { return net_listen_v11(NULL, dev, handle, listenComm); }

static void comm_init_common(nw_comm_t* c, int is_send, int nsocks, uint64_t sockchunk) {
  c->is_send = is_send;
  c->nsocks = nsocks;
  c->sockchunk = sockchunk;
}

static ncclResult_t net_accept(void* listenComm, void** recvComm, ncclNetDeviceHandle_t** recvDevComm) {
  (void)recvDevComm;
  nw_listen_t* l = listenComm;
  *recvComm = NULL;
  for (;;) { /* take every connection waiting in the backlog */
    if (l->npending == NW_MAX_PENDING) break;
    int fd = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
      NW_WARN("accept: %s", strerror(errno));
      return ncclSystemError;
    }
    set_nodelay(fd);
    nw_pending_t* p = &l->pending[l->npending++];
    p->fd = fd;
    p->off = 0;
  }
  for (int i = 0; i < l->npending;) {
    nw_pending_t* p = &l->pending[i];
    ssize_t n = recv(p->fd, (char*)&p->hello + p->off, sizeof(p->hello) - p->off, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) { i++; continue; }
    if (n <= 0) { NW_WARN("connection closed during handshake"); close(p->fd); *p = l->pending[--l->npending]; continue; }
    p->off += (uint32_t)n;
    if (p->off < sizeof(p->hello)) { i++; continue; }
    nw_hello_t* hh = &p->hello;
    if (hh->magic != NW_HELLO_MAGIC || hh->version != NW_VERSION || hh->nonce != l->nonce || hh->nsocks < 1 ||
        hh->nsocks > NW_MAX_SOCKS || hh->index > hh->nsocks) {
      NW_WARN("rejecting a connection with a bad handshake (magic %x version %u nsocks %u)", hh->magic, hh->version, hh->nsocks);
      close(p->fd);
      *p = l->pending[--l->npending];
      continue;
    }
    nw_group_t* g = NULL;
    for (int k = 0; k < l->ngroups; k++)
      if (l->groups[k].conn_id == hh->conn_id) g = &l->groups[k];
    if (g == NULL) {
      if (l->ngroups == 8) { i++; continue; } /* try again once a group completes */
      g = &l->groups[l->ngroups++];
      memset(g, 0, sizeof(*g));
      g->conn_id = hh->conn_id;
      g->nsocks = hh->nsocks;
      g->hello = *hh;
      for (int k = 0; k <= NW_MAX_SOCKS; k++) g->fds[k] = -1;
    }
    if (g->fds[hh->index] != -1) { close(p->fd); *p = l->pending[--l->npending]; continue; }
    g->fds[hh->index] = p->fd;
    g->have++;
    *p = l->pending[--l->npending];
  }
  for (int k = 0; k < l->ngroups; k++) {
    nw_group_t* g = &l->groups[k];
    if (g->have != g->nsocks + 1) continue;
    nw_comm_t* c = calloc(1, sizeof(*c));
    if (c == NULL) return ncclSystemError;
    comm_init_common(c, 0, g->nsocks, g->hello.sockchunk);
    c->ctrl = g->fds[0];
    for (int s = 0; s < g->nsocks; s++) c->fds[s] = g->fds[s + 1];
    /* the receiving side marks its sockets like the sender so ACKs travel in the same class */
    c->dscp = g->hello.dscp;
    c->prio = g->hello.prio;
    c->rate = NW_UNSET;
    c->ncclClass = -1;
    c->order = -1;
    mark_comm_sockets(c);
    *g = l->groups[--l->ngroups];
    *recvComm = c;
    return ncclSuccess;
  }
  return ncclSuccess;
}

static ncclResult_t net_close_listen(void* listenComm) {
  nw_listen_t* l = listenComm;
  if (l == NULL) return ncclSuccess;
  for (int i = 0; i < l->npending; i++) close(l->pending[i].fd);
  for (int k = 0; k < l->ngroups; k++)
    for (int s = 0; s <= NW_MAX_SOCKS; s++)
      if (l->groups[k].fds[s] >= 0) close(l->groups[k].fds[s]);
  close(l->fd);
  free(l);
  return ncclSuccess;
}

/* --------------------------------------------------------------- connect -- */
static void stage_free(nw_stage_t* st) {
  for (int i = 0; i <= st->nsocks; i++)
    if (st->fds[i] >= 0) close(st->fds[i]);
  free(st);
}

static ncclResult_t connect_common(const nw_mark_t* mark, uint64_t commId, int ncclClass, int order, void* opaque, void** sendComm) {
  nw_handle_t* h = opaque;
  *sendComm = NULL;
  if (h->magic != NW_HANDLE_MAGIC || h->version != NW_VERSION) {
    NW_WARN("connect: handle is not a netweave handle (magic %x)", h->magic);
    return ncclInvalidArgument;
  }
  nw_stage_t* st = h->stage;
  if (st == NULL) {
    st = calloc(1, sizeof(*st));
    if (st == NULL) return ncclSystemError;
    st->mark = *mark;
    st->commId = commId;
    st->ncclClass = ncclClass;
    st->order = order;
    st->nsocks = mark->nsocks != NW_UNSET ? mark->nsocks : env_int("NETWEAVE_NSOCKS", 2, 1, NW_MAX_SOCKS);
    int64_t chunk = mark->sockchunk != NW_UNSET ? mark->sockchunk : env_int("NETWEAVE_SOCKCHUNK", 128 * 1024, 4096, 1 << 30);
    for (int i = 0; i <= NW_MAX_SOCKS; i++) st->fds[i] = -1;
    st->hello.magic = NW_HELLO_MAGIC;
    st->hello.version = NW_VERSION;
    st->hello.nsocks = (uint16_t)st->nsocks;
    st->hello.dscp = (int16_t)mark->dscp;
    st->hello.prio = mark->prio;
    st->hello.sockchunk = (uint32_t)chunk;
    st->hello.conn_id = random_u64();
    st->hello.nonce = h->nonce;
    for (int i = 0; i <= st->nsocks; i++) {
      int fd = socket(h->addr.sa.sa_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) { NW_WARN("socket: %s", strerror(errno)); stage_free(st); return ncclSystemError; }
      st->fds[i] = fd;
      set_nodelay(fd);
      /* mark before connect so the SYN already carries the class */
      nw_sock_mark(fd, mark->dscp, mark->prio, NW_UNSET);
      if (connect(fd, &h->addr.sa, addr_len(&h->addr)) != 0 && errno != EINPROGRESS) {
        NW_WARN("connect: %s", strerror(errno));
        stage_free(st);
        return ncclSystemError;
      }
    }
    h->stage = st;
  }
  int ready = 0;
  for (int i = 0; i <= st->nsocks; i++) {
    if (st->state[i] == 0) {
      struct pollfd pfd = {st->fds[i], POLLOUT, 0};
      if (poll(&pfd, 1, 0) <= 0) continue;
      int err = 0;
      socklen_t el = sizeof(err);
      getsockopt(st->fds[i], SOL_SOCKET, SO_ERROR, &err, &el);
      if (err != 0) {
        NW_WARN("connect: %s", strerror(err));
        h->stage = NULL;
        stage_free(st);
        return ncclRemoteError;
      }
      st->state[i] = 1;
    }
    if (st->state[i] == 1) {
      nw_hello_t hello = st->hello;
      hello.index = (uint16_t)i;
      ssize_t n = send(st->fds[i], (char*)&hello + st->off[i], sizeof(hello) - st->off[i], MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        NW_WARN("handshake: %s", strerror(errno));
        h->stage = NULL;
        stage_free(st);
        return ncclRemoteError;
      }
      if (n > 0) st->off[i] += (uint32_t)n;
      if (st->off[i] == sizeof(hello)) st->state[i] = 2;
    }
    if (st->state[i] == 2) ready++;
  }
  if (ready <= st->nsocks) return ncclSuccess; /* not yet: NCCL calls again */
  nw_comm_t* c = calloc(1, sizeof(*c));
  if (c == NULL) return ncclSystemError;
  comm_init_common(c, 1, st->nsocks, st->hello.sockchunk);
  c->ctrl = st->fds[0];
  for (int s = 0; s < st->nsocks; s++) c->fds[s] = st->fds[s + 1];
  c->commId = st->commId;
  c->ncclClass = st->ncclClass;
  c->order = st->order;
  c->dscp = st->mark.dscp;
  c->prio = st->mark.prio;
  c->rate = st->mark.rate;
  c->plan_gen = nw_plan_snapshot(NULL);
  mark_comm_sockets(c);
  free(st);
  h->stage = NULL;
  *sendComm = c;
  return ncclSuccess;
}

static ncclResult_t net_connect_v11(void* ctx, int dev, void* handle, void** sendComm, ncclNetDeviceHandle_t** sendDevComm) {
  (void)dev; (void)sendDevComm;
  nw_ctx_t* x = ctx;
  if (x == NULL) return ncclInvalidArgument;
  return connect_common(&x->mark, x->commId, x->ncclClass, x->order, handle, sendComm);
}

static ncclResult_t net_connect_v10(int dev, ncclNetCommConfig_t* config, void* handle, void** sendComm, ncclNetDeviceHandle_t** sendDevComm) {
  (void)dev; (void)sendDevComm;
  int cls = config ? config->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF;
  nw_plan_t* plan = malloc(sizeof(*plan));
  if (plan == NULL) return ncclSystemError;
  nw_plan_snapshot(plan);
  nw_mark_t m;
  nw_plan_resolve(plan, 0, -1, cls, &m); /* v10 has no communicator id: class rules only */
  free(plan);
  return connect_common(&m, 0, cls, -1, handle, sendComm);
}

/* ------------------------------------------------------------- data path -- */
static ncclResult_t net_regmr(void* comm, void* data, size_t size, int type, void** mhandle) {
  (void)comm; (void)data; (void)size;
  *mhandle = NULL;
  return type == NCCL_PTR_HOST ? ncclSuccess : ncclInternalError;
}
static ncclResult_t net_deregmr(void* comm, void* mhandle) { (void)comm; (void)mhandle; return ncclSuccess; }

static nw_req_t* req_alloc(nw_comm_t* c, int nmsgs) {
  for (int k = 0; k < nmsgs; k++)
    if (c->msgs[(c->tail + (uint64_t)k) % NW_MSG_RING].used) return NULL;
  for (int i = 0; i < NCCL_NET_MAX_REQUESTS; i++)
    if (!c->reqs[i].used) {
      nw_req_t* r = &c->reqs[i];
      memset(r, 0, sizeof(*r));
      r->used = 1;
      r->comm = c;
      r->n = nmsgs;
      r->first = c->tail;
      for (int k = 0; k < nmsgs; k++) {
        nw_msg_t* m = &c->msgs[(c->tail + (uint64_t)k) % NW_MSG_RING];
        memset(m, 0, sizeof(*m));
        m->used = 1;
        m->req = r;
      }
      c->tail += (uint64_t)nmsgs;
      return r;
    }
  return NULL;
}

static ncclResult_t net_isend(void* sendComm, void* data, size_t size, int tag, void* mhandle, void* phandle, void** request) {
  (void)mhandle; (void)phandle;
  nw_comm_t* c = sendComm;
  *request = NULL;
  if (c->failed) return (ncclResult_t)c->failed;
  if (size > NW_MAX_MSG_BYTES) { NW_WARN("isend of %zu bytes exceeds maxP2pBytes", size); return ncclInvalidArgument; }
  refresh_marks(c);
  nw_req_t* r = req_alloc(c, 1);
  if (r == NULL) return ncclSuccess; /* all request slots busy: NCCL retries */
  r->is_send = 1;
  r->data[0] = data;
  r->cap[0] = size;
  r->tags[0] = tag;
  nw_msg_t* m = &c->msgs[r->first % NW_MSG_RING];
  m->data = data;
  m->size = size;
  m->hdr.magic = NW_HDR_MAGIC;
  m->hdr.tag = tag;
  m->hdr.size = size;
  *request = r;
  return ncclSuccess;
}

static ncclResult_t net_irecv(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles, void** phandles, void** request) {
  (void)mhandles; (void)phandles;
  nw_comm_t* c = recvComm;
  *request = NULL;
  if (c->failed) return (ncclResult_t)c->failed;
  if (n < 1 || n > NW_MAX_RECVS) { NW_WARN("irecv with n=%d (supported 1..%d)", n, NW_MAX_RECVS); return ncclInternalError; }
  nw_req_t* r = req_alloc(c, n);
  if (r == NULL) return ncclSuccess;
  for (int k = 0; k < n; k++) {
    r->data[k] = data[k];
    r->cap[k] = sizes[k];
    r->tags[k] = tags ? tags[k] : 0;
  }
  *request = r;
  return ncclSuccess;
}

static ncclResult_t net_iflush(void* recvComm, int n, void** data, int* sizes, void** mhandles, void** request) {
  (void)recvComm; (void)n; (void)data; (void)sizes; (void)mhandles;
  *request = NULL;
  return ncclInternalError; /* host buffers only: NCCL never flushes them */
}

static ncclResult_t fail(nw_comm_t* c, ncclResult_t r) {
  c->failed = (int)r;
  return r;
}

static int would_block(void) { return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR; }

/* a received header: bind the message to a buffer of its request */
static ncclResult_t bind_header(nw_comm_t* c, nw_msg_t* m) {
  nw_req_t* r = m->req;
  if (m->hdr.magic != NW_HDR_MAGIC) { NW_WARN("corrupt message header (magic %x)", m->hdr.magic); return fail(c, ncclRemoteError); }
  int slot = -1;
  if (r->n == 1) {
    slot = r->taken[0] ? -1 : 0;
  } else {
    for (int k = 0; k < r->n && slot < 0; k++)
      if (!r->taken[k] && r->tags[k] == m->hdr.tag) slot = k;
  }
  if (slot < 0) { NW_WARN("message with tag %d matches no posted receive", m->hdr.tag); return fail(c, ncclInternalError); }
  if (m->hdr.size > r->cap[slot]) {
    NW_WARN("message of %lu bytes is larger than the posted buffer of %zu bytes", (unsigned long)m->hdr.size, r->cap[slot]);
    return fail(c, ncclInternalError);
  }
  r->taken[slot] = 1;
  r->got[slot] = m->hdr.size;
  m->data = r->data[slot];
  m->size = m->hdr.size;
  return ncclSuccess;
}

static ncclResult_t progress(nw_comm_t* c) {
  if (c->failed) return (ncclResult_t)c->failed;
  while (c->ctrl_seq < c->tail) {
    nw_msg_t* m = &c->msgs[c->ctrl_seq % NW_MSG_RING];
    char* p = (char*)&m->hdr + m->hdr_off;
    size_t left = sizeof(m->hdr) - m->hdr_off;
    ssize_t n = c->is_send ? send(c->ctrl, p, left, MSG_DONTWAIT | MSG_NOSIGNAL) : recv(c->ctrl, p, left, MSG_DONTWAIT);
    if (n < 0 && would_block()) break;
    if (n <= 0) {
      NW_WARN("control socket %s: %s", c->is_send ? "send" : "recv", n == 0 ? "peer closed" : strerror(errno));
      return fail(c, ncclRemoteError);
    }
    m->hdr_off += (uint32_t)n;
    if (m->hdr_off < sizeof(m->hdr)) break;
    if (!c->is_send) {
      ncclResult_t r = bind_header(c, m);
      if (r != ncclSuccess) return r;
    }
    c->ctrl_seq++;
  }
  for (int s = 0; s < c->nsocks; s++) {
    while (c->sock_seq[s] < c->ctrl_seq) {
      nw_msg_t* m = &c->msgs[c->sock_seq[s] % NW_MSG_RING];
      uint64_t total = portion(m->size, c->sockchunk, c->nsocks, s);
      int blocked = 0;
      while (m->done[s] < total) {
        uint64_t j = m->done[s] / c->sockchunk, within = m->done[s] % c->sockchunk;
        uint64_t g = j * (uint64_t)c->nsocks + (uint64_t)s;
        uint64_t off = g * c->sockchunk + within;
        uint64_t len = (m->size - g * c->sockchunk < c->sockchunk ? m->size - g * c->sockchunk : c->sockchunk) - within;
        ssize_t n = c->is_send ? send(c->fds[s], m->data + off, len, MSG_DONTWAIT | MSG_NOSIGNAL)
                               : recv(c->fds[s], m->data + off, len, MSG_DONTWAIT);
        if (n < 0 && would_block()) { blocked = 1; break; }
        if (n <= 0) {
          NW_WARN("data socket %d %s: %s", s, c->is_send ? "send" : "recv", n == 0 ? "peer closed" : strerror(errno));
          return fail(c, ncclRemoteError);
        }
        m->done[s] += (uint64_t)n;
      }
      if (blocked) break;
      c->sock_seq[s]++;
    }
  }
  return ncclSuccess;
}

static void emit_net_event(nw_comm_t* c, nw_req_t* r, uint64_t bytes) {
  nw_ring_t* ring = nw_ring_get();
  if (ring == NULL) return;
  nw_record_t rec;
  memset(&rec, 0, sizeof(rec));
  rec.kind = r->is_send ? NW_EV_NET_SEND : NW_EV_NET_RECV;
  rec.comm_id = c->commId;
  rec.coll_seq = r->first;
  rec.bytes = bytes;
  rec.event_id = nw_next_event_id();
  rec.func = rec.algo = rec.proto = rec.channel = 0xff;
  rec.is_send = (uint8_t)r->is_send;
  rec.traffic_class = (int8_t)(c->dscp >= 0 ? c->dscp / 8 : -1);
  rec.peer = -1;
  rec.step = r->n;
  nw_ring_put(ring, &rec);
}

static ncclResult_t net_test(void* request, int* done, int* sizes) {
  nw_req_t* r = request;
  *done = 0;
  if (r == NULL || !r->used) return ncclInternalError;
  nw_comm_t* c = r->comm;
  ncclResult_t res = progress(c);
  if (res != ncclSuccess) return res;
  uint64_t last = r->first + (uint64_t)r->n - 1;
  if (c->ctrl_seq <= last) return ncclSuccess;
  for (int s = 0; s < c->nsocks; s++)
    if (c->sock_seq[s] <= last) return ncclSuccess;
  *done = 1;
  uint64_t bytes = 0;
  for (int k = 0; k < r->n; k++) {
    uint64_t b = r->is_send ? r->cap[k] : r->got[k];
    bytes += b;
    if (sizes) sizes[k] = (int)b;
  }
  emit_net_event(c, r, bytes);
  for (int k = 0; k < r->n; k++) c->msgs[(r->first + (uint64_t)k) % NW_MSG_RING].used = 0;
  r->used = 0;
  return ncclSuccess;
}

static ncclResult_t net_close(void* comm) {
  nw_comm_t* c = comm;
  if (c == NULL) return ncclSuccess;
  close(c->ctrl);
  for (int s = 0; s < c->nsocks; s++) close(c->fds[s]);
  free(c);
  return ncclSuccess;
}

/* ------------------------------------------------------- function tables -- */
#define NET_TAIL                                                                                              \
  net_accept, net_regmr, NULL /* regMrDmaBuf */, net_deregmr, net_isend, net_irecv, net_iflush, net_test,   \
      net_close, net_close, net_close_listen, NULL /* getDeviceMr */, NULL /* irecvConsumed */,               \
      NULL /* makeVDevice */

NW_EXPORT const ncclNet_v12_t ncclNetPlugin_v12 = {NW_PLUGIN_NAME, net_init_v11, net_devices, net_props_v12, net_listen_v11,
                                                   net_connect_v11, NET_TAIL, net_finalize, net_set_attr};
NW_EXPORT const ncclNet_v11_t ncclNetPlugin_v11 = {NW_PLUGIN_NAME, net_init_v11, net_devices, net_props_v11, net_listen_v11,
                                                   net_connect_v11, NET_TAIL, net_finalize, net_set_attr};
NW_EXPORT const ncclNet_v10_t ncclNetPlugin_v10 = {NW_PLUGIN_NAME, net_init_v10, net_devices, net_props_v10, net_listen_v10,
                                                   net_connect_v10, NET_TAIL};

/* ABI self-description for harnesses: the library's own struct sizes. */
NW_EXPORT const uint32_t netweave_abi_sizes[] = {sizeof(ncclNet_v10_t), sizeof(ncclNet_v11_t), sizeof(ncclNet_v12_t),
                                                 sizeof(ncclNetProperties_v12_t), sizeof(nw_record_t), sizeof(nw_ring_header_t)};
