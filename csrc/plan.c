/* netweave: flow-plan file parser, communicator registry, logging, socket marking.
 *
 * Plan file grammar (one rule per line, '#' starts a comment, keys are key=value):
 *   netweave-plan 1
 *   class <k> [dscp=D] [prio=P] [rate=B/s] [nsocks=N] [sockchunk=B]
 *   comm  <commId hex|decimal> [class=K] [dscp=] [prio=] [rate=] [nsocks=] [sockchunk=]
 *   order <n> ...same keys as comm: the n-th communicator initialised in this process
 *   tune  <*|class:K|comm:ID|order:N> [coll=allreduce] [min=B] [max=B] [algo=ring] [proto=simple]
 *         [channels=N] [chunk=B]
 *   mark  <*|port> [dscp=D] [prio=P]        (for libnetweave-mark.so)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
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

/* ---------------------------------------------------------------- names -- */
static const char* const algo_names[] = {"tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat"};
static const char* const proto_names[] = {"ll", "ll128", "simple"};
static const char* const func_names[] = {"broadcast", "reduce", "allgather", "reducescatter", "allreduce",
                                         "sendrecv", "send", "recv", "alltoall", "scatter", "gather", "allgatherv"};

static int index_of(const char* s, const char* const* names, int n) {
  if (s == NULL) return NW_UNSET;
  char buf[32];
  size_t j = 0;
  /* accept NCCL's spellings too: "AllReduce", "ncclFuncAllReduce", "RING", "all_reduce" */
  if (strncmp(s, "ncclFunc", 8) == 0) s += 8;
  for (size_t i = 0; s[i] != '\0' && j + 1 < sizeof(buf); i++)
    if (s[i] != '_') buf[j++] = (char)((s[i] >= 'A' && s[i] <= 'Z') ? s[i] + 32 : s[i]);
  buf[j] = '\0';
  for (int i = 0; i < n; i++)
    if (strcmp(buf, names[i]) == 0) return i;
  return NW_UNSET;
}
int nw_algo_from_name(const char* s) { return index_of(s, algo_names, 7); }
int nw_proto_from_name(const char* s) { return index_of(s, proto_names, 3); }
int nw_func_from_name(const char* s) { return index_of(s, func_names, 12); }

/* ---------------------------------------------------------------- plan -- */
void nw_mark_clear(nw_mark_t* m) {
  m->cls = m->dscp = m->prio = m->nsocks = NW_UNSET;
  m->rate = m->sockchunk = NW_UNSET;
}

void nw_plan_defaults(nw_plan_t* plan) {
  memset(plan, 0, sizeof(*plan));
  plan->version = 1;
  /* trafficClass k -> class selector CSk (DSCP 8k) and SO_PRIORITY k: higher class, more urgent */
  for (int k = 0; k < NW_NUM_CLASSES; k++) {
    nw_mark_clear(&plan->cls[k]);
    plan->cls[k].dscp = 8 * k;
    plan->cls[k].prio = k;
  }
}

static int parse_u64(const char* s, uint64_t* out) {
  char* end = NULL;
  errno = 0;
  if (s[0] == '-') return -1;
  unsigned long long v = strtoull(s, &end, 0);
  if (errno != 0 || end == s) return -1;
  /* optional binary suffixes k, m, g (x1024) */
  if (*end == 'k' || *end == 'K') { v <<= 10; end++; }
  else if (*end == 'm' || *end == 'M') { v <<= 20; end++; }
  else if (*end == 'g' || *end == 'G') { v <<= 30; end++; }
  if (*end != '\0') return -1;
  *out = v;
  return 0;
}

static int parse_int_range(const char* s, long lo, long hi, int* out) {
  uint64_t v;
  if (parse_u64(s, &v) != 0 || (long)v < lo || (long)v > hi) return -1;
  *out = (int)v;
  return 0;
}

#define PERR(...) do { snprintf(err, errlen, __VA_ARGS__); return -1; } while (0)

static int parse_mark_key(const char* key, const char* val, nw_mark_t* m, int allow_class, int lineno, char* err, size_t errlen) {
  uint64_t v;
  if (strcmp(key, "dscp") == 0) {
    if (parse_int_range(val, 0, 63, &m->dscp) != 0) PERR("line %d: dscp must be an integer 0..63, got '%s'", lineno, val);
  } else if (strcmp(key, "prio") == 0 || strcmp(key, "priority") == 0) {
    if (parse_int_range(val, 0, 0x7fffffff, &m->prio) != 0) PERR("line %d: prio must be a non-negative integer, got '%s'", lineno, val);
  } else if (strcmp(key, "rate") == 0) {
    if (parse_u64(val, &v) != 0) PERR("line %d: rate must be bytes per second, got '%s'", lineno, val);
    m->rate = (int64_t)v;
  } else if (strcmp(key, "nsocks") == 0) {
    if (parse_int_range(val, 1, 16, &m->nsocks) != 0) PERR("line %d: nsocks must be 1..16, got '%s'", lineno, val);
  } else if (strcmp(key, "sockchunk") == 0) {
    if (parse_u64(val, &v) != 0 || v < 4096 || v > (1u << 30)) PERR("line %d: sockchunk must be 4096..1G bytes, got '%s'", lineno, val);
    m->sockchunk = (int64_t)v;
  } else if (allow_class && strcmp(key, "class") == 0) {
    if (parse_int_range(val, 0, NW_NUM_CLASSES - 1, &m->cls) != 0) PERR("line %d: class must be 0..7, got '%s'", lineno, val);
  } else {
    PERR("line %d: unknown key '%s'", lineno, key);
  }
  return 0;
}

static int parse_selector(const char* s, int* sel, uint64_t* id) {
  if (strcmp(s, "*") == 0) { *sel = NW_SEL_ANY; *id = 0; return 0; }
  if (strncmp(s, "class:", 6) == 0) { *sel = NW_SEL_CLASS; return parse_u64(s + 6, id) != 0 || *id >= NW_NUM_CLASSES ? -1 : 0; }
  if (strncmp(s, "comm:", 5) == 0) { *sel = NW_SEL_COMM; return parse_u64(s + 5, id); }
  if (strncmp(s, "order:", 6) == 0) { *sel = NW_SEL_ORDER; return parse_u64(s + 6, id); }
  return -1;
}

int nw_plan_parse(const char* text, nw_plan_t* plan, char* err, size_t errlen) {
  nw_plan_defaults(plan);
  int lineno = 0, seen_header = 0;
  const char* p = text;
  while (*p != '\0') {
    const char* eol = strchr(p, '\n');
    size_t len = eol ? (size_t)(eol - p) : strlen(p);
    char line[1024];
    lineno++;
    if (len >= sizeof(line)) PERR("line %d: longer than %zu characters", lineno, sizeof(line) - 1);
    memcpy(line, p, len);
    line[len] = '\0';
    p = eol ? eol + 1 : p + len;
    char* hash = strchr(line, '#');
    if (hash) *hash = '\0';
    char* tok[24];
    int nt = 0;
    char* save = NULL;
    for (char* t = strtok_r(line, " \t\r", &save); t != NULL; t = strtok_r(NULL, " \t\r", &save)) {
      if (nt == 24) PERR("line %d: too many fields (at most 24)", lineno);
      tok[nt++] = t;
    }
    if (nt == 0) continue;
    if (!seen_header) {
      if (strcmp(tok[0], "netweave-plan") != 0 || nt != 2) PERR("line %d: expected the header 'netweave-plan 1'", lineno);
      if (strcmp(tok[1], "1") != 0) PERR("line %d: unsupported plan version '%s' (this library reads 1)", lineno, tok[1]);
      seen_header = 1;
      continue;
    }
    if (nt < 2) PERR("line %d: '%s' needs a selector", lineno, tok[0]);
    if (strcmp(tok[0], "class") == 0) {
      int k;
      if (parse_int_range(tok[1], 0, NW_NUM_CLASSES - 1, &k) != 0) PERR("line %d: class must be 0..7, got '%s'", lineno, tok[1]);
      for (int i = 2; i < nt; i++) {
        char* eq = strchr(tok[i], '=');
        if (!eq) PERR("line %d: expected key=value, got '%s'", lineno, tok[i]);
        *eq = '\0';
        if (parse_mark_key(tok[i], eq + 1, &plan->cls[k], 0, lineno, err, errlen) != 0) return -1;
      }
    } else if (strcmp(tok[0], "comm") == 0 || strcmp(tok[0], "order") == 0) {
      if (plan->ncomm == NW_MAX_RULES) PERR("line %d: more than %d comm/order rules", lineno, NW_MAX_RULES);
      nw_comm_rule_t* r = &plan->comm[plan->ncomm];
      r->sel = tok[0][0] == 'c' ? NW_SEL_COMM : NW_SEL_ORDER;
      if (parse_u64(tok[1], &r->id) != 0) PERR("line %d: '%s' needs an integer id, got '%s'", lineno, tok[0], tok[1]);
      nw_mark_clear(&r->m);
      for (int i = 2; i < nt; i++) {
        char* eq = strchr(tok[i], '=');
        if (!eq) PERR("line %d: expected key=value, got '%s'", lineno, tok[i]);
        *eq = '\0';
        if (parse_mark_key(tok[i], eq + 1, &r->m, 1, lineno, err, errlen) != 0) return -1;
      }
      plan->ncomm++;
    } else if (strcmp(tok[0], "tune") == 0) {
      if (plan->ntune == NW_MAX_RULES) PERR("line %d: more than %d tune rules", lineno, NW_MAX_RULES);
      nw_tune_rule_t* r = &plan->tune[plan->ntune];
      if (parse_selector(tok[1], &r->sel, &r->id) != 0) PERR("line %d: tune selector must be *, class:K, comm:ID or order:N, got '%s'", lineno, tok[1]);
      r->coll = r->algo = r->proto = r->channels = NW_UNSET;
      r->chunk = NW_UNSET;
      r->min_bytes = 0;
      r->max_bytes = UINT64_MAX;
      for (int i = 2; i < nt; i++) {
        char* eq = strchr(tok[i], '=');
        if (!eq) PERR("line %d: expected key=value, got '%s'", lineno, tok[i]);
        *eq = '\0';
        const char *k = tok[i], *v = eq + 1;
        uint64_t u;
        if (strcmp(k, "coll") == 0) {
          if ((r->coll = nw_func_from_name(v)) == NW_UNSET) PERR("line %d: unknown collective '%s'", lineno, v);
        } else if (strcmp(k, "algo") == 0) {
          if ((r->algo = nw_algo_from_name(v)) == NW_UNSET) PERR("line %d: unknown algorithm '%s' (tree, ring, collnet_direct, collnet_chain, nvls, nvls_tree, pat)", lineno, v);
        } else if (strcmp(k, "proto") == 0) {
          if ((r->proto = nw_proto_from_name(v)) == NW_UNSET) PERR("line %d: unknown protocol '%s' (ll, ll128, simple)", lineno, v);
        } else if (strcmp(k, "channels") == 0) {
          if (parse_int_range(v, 1, 64, &r->channels) != 0) PERR("line %d: channels must be 1..64, got '%s'", lineno, v);
        } else if (strcmp(k, "chunk") == 0) {
          if (parse_u64(v, &u) != 0 || u == 0) PERR("line %d: chunk must be a positive byte count, got '%s'", lineno, v);
          r->chunk = (int64_t)u;
        } else if (strcmp(k, "min") == 0) {
          if (parse_u64(v, &r->min_bytes) != 0) PERR("line %d: min must be a byte count, got '%s'", lineno, v);
        } else if (strcmp(k, "max") == 0) {
          if (parse_u64(v, &r->max_bytes) != 0) PERR("line %d: max must be a byte count, got '%s'", lineno, v);
        } else {
          PERR("line %d: unknown tune key '%s'", lineno, k);
        }
      }
      if ((r->algo == NW_UNSET) != (r->proto == NW_UNSET)) PERR("line %d: give algo and proto together (NCCL takes both or neither)", lineno);
      if (r->min_bytes > r->max_bytes) PERR("line %d: min > max", lineno);
      plan->ntune++;
    } else if (strcmp(tok[0], "mark") == 0) {
      if (plan->nport == NW_MAX_RULES) PERR("line %d: more than %d mark rules", lineno, NW_MAX_RULES);
      nw_port_rule_t* r = &plan->port[plan->nport];
      r->dscp = r->prio = NW_UNSET;
      if (strcmp(tok[1], "*") == 0) r->port = NW_UNSET;
      else if (parse_int_range(tok[1], 1, 65535, &r->port) != 0) PERR("line %d: mark selector must be * or a port 1..65535, got '%s'", lineno, tok[1]);
      for (int i = 2; i < nt; i++) {
        char* eq = strchr(tok[i], '=');
        if (!eq) PERR("line %d: expected key=value, got '%s'", lineno, tok[i]);
        *eq = '\0';
        nw_mark_t m;
        nw_mark_clear(&m);
        if (strcmp(tok[i], "dscp") != 0 && strcmp(tok[i], "prio") != 0) PERR("line %d: mark takes dscp= and prio= only, got '%s'", lineno, tok[i]);
        if (parse_mark_key(tok[i], eq + 1, &m, 0, lineno, err, errlen) != 0) return -1;
        if (m.dscp != NW_UNSET) r->dscp = m.dscp;
        if (m.prio != NW_UNSET) r->prio = m.prio;
      }
      plan->nport++;
    } else {
      PERR("line %d: unknown rule '%s' (class, comm, order, tune, mark)", lineno, tok[0]);
    }
  }
  if (!seen_header) PERR("line %d: empty plan, expected the header 'netweave-plan 1'", lineno);
  return 0;
}

static void overlay(nw_mark_t* dst, const nw_mark_t* src) {
  if (src->dscp != NW_UNSET) dst->dscp = src->dscp;
  if (src->prio != NW_UNSET) dst->prio = src->prio;
  if (src->rate != NW_UNSET) dst->rate = src->rate;
  if (src->nsocks != NW_UNSET) dst->nsocks = src->nsocks;
  if (src->sockchunk != NW_UNSET) dst->sockchunk = src->sockchunk;
}

void nw_plan_resolve(const nw_plan_t* plan, uint64_t commId, int order, int ncclClass, nw_mark_t* out) {
  nw_mark_t own;
  nw_mark_clear(&own);
  /* order rules first, commId rules after: the more specific one wins */
  for (int pass = 0; pass < 2; pass++)
    for (int i = 0; i < plan->ncomm; i++) {
      const nw_comm_rule_t* r = &plan->comm[i];
      int hit = pass == 0 ? (r->sel == NW_SEL_ORDER && order >= 0 && r->id == (uint64_t)order)
                          : (r->sel == NW_SEL_COMM && r->id == commId);
      if (!hit) continue;
      if (r->m.cls != NW_UNSET) own.cls = r->m.cls;
      overlay(&own, &r->m);
    }
  int cls = own.cls != NW_UNSET ? own.cls : ncclClass;
  nw_mark_clear(out);
  if (cls >= 0 && cls < NW_NUM_CLASSES) overlay(out, &plan->cls[cls]);
  overlay(out, &own);
  out->cls = (cls >= 0 && cls < NW_NUM_CLASSES) ? cls : NW_UNSET;
}

static pthread_mutex_t plan_lock = PTHREAD_MUTEX_INITIALIZER;
static nw_plan_t plan_current;
static int plan_ready = 0;
static struct timespec plan_mtime;
static off_t plan_size = -1;
static uint64_t plan_checked_ns = 0;
static uint64_t plan_generation = 0;

uint64_t nw_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void plan_reload_locked(void) {
  const char* path = getenv("NETWEAVE_PLAN");
  if (!plan_ready) {
    nw_plan_defaults(&plan_current);
    plan_current.generation = ++plan_generation;
    plan_ready = 1;
  }
  if (path == NULL || path[0] == '\0') return;
  struct stat st;
  if (stat(path, &st) != 0) return; /* keep the last good plan (or the defaults) */
  if (plan_size == st.st_size && plan_mtime.tv_sec == st.st_mtim.tv_sec && plan_mtime.tv_nsec == st.st_mtim.tv_nsec) return;
  FILE* f = fopen(path, "r");
  if (f == NULL) return;
  char* text = malloc((size_t)st.st_size + 1);
  size_t got = text ? fread(text, 1, (size_t)st.st_size, f) : 0;
  fclose(f);
  if (text == NULL) return;
  text[got] = '\0';
  plan_size = st.st_size;
  plan_mtime = st.st_mtim;
  nw_plan_t* fresh = malloc(sizeof(*fresh));
  char err[256];
  if (fresh != NULL && nw_plan_parse(text, fresh, err, sizeof(err)) == 0) {
    fresh->generation = ++plan_generation;
    plan_current = *fresh;
    NW_INFO(NCCL_INIT | NCCL_NET, "loaded plan %s (generation %" PRIu64 ")", path, plan_generation);
  } else if (fresh != NULL) {
    NW_WARN("plan %s: %s; keeping the previous plan", path, err);
  }
  free(fresh);
  free(text);
}

uint64_t nw_plan_snapshot(nw_plan_t* out) {
  pthread_mutex_lock(&plan_lock);
  uint64_t now = nw_now_ns();
  if (!plan_ready || now - plan_checked_ns > 100000000ull) {
    plan_checked_ns = now;
    plan_reload_locked();
  }
  if (out) *out = plan_current;
  uint64_t gen = plan_current.generation;
  pthread_mutex_unlock(&plan_lock);
  return gen;
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

/* Exported for tests (ctypes): parse plan text and resolve one communicator's marks.
 * out = {class, dscp, prio, rate, nsocks, sockchunk} (-1 = unset). Returns 0, or -1 with err. */
NW_EXPORT int netweave_plan_resolve_text(const char* text, uint64_t commId, int order, int ncclClass, int64_t* out, char* err,
                                         size_t errlen) {
  nw_plan_t* plan = malloc(sizeof(*plan));
  if (plan == NULL) return -1;
  int rc = nw_plan_parse(text, plan, err, errlen);
  if (rc == 0) {
    nw_mark_t m;
    nw_plan_resolve(plan, commId, order, ncclClass, &m);
    out[0] = m.cls; out[1] = m.dscp; out[2] = m.prio; out[3] = m.rate; out[4] = m.nsocks; out[5] = m.sockchunk;
  }
  free(plan);
  return rc;
}
