/* netweave NCCL hook: internals shared by the net, tuner and profiler roles. */
#ifndef NETWEAVE_NW_H_
#define NETWEAVE_NW_H_

#include <stdint.h>
#include <stddef.h>
#include "include/nccl_abi.h"

#define NW_HIDDEN __attribute__((visibility("hidden")))
#define NW_EXPORT __attribute__((visibility("default")))

#define NW_PLUGIN_NAME "netweave"
#define NW_NUM_CLASSES 8
#define NW_MAX_RULES 64
#define NW_UNSET (-1)

/* ------------------------------------------------------------- logging -- */
NW_HIDDEN extern ncclDebugLogger_t nw_logger;
NW_HIDDEN void nw_log(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));
#define NW_WARN(...) nw_log(NCCL_LOG_WARN, NCCL_NET, __FILE__, __LINE__, __VA_ARGS__)
#define NW_INFO(flags, ...) nw_log(NCCL_LOG_INFO, (flags), __FILE__, __LINE__, __VA_ARGS__)

/* ---------------------------------------------------------------- plan -- */
/* The flow-plan grammar, version 1 (docs/ncclhook.md "Flow-plan file"; implemented once, in plan.c). */
#define NW_PLAN_VERSION 1
#define NW_PLAN_ABI 2                /* layout of nw_plan_t as exported to flowsched.ncclhook (ctypes) */
#define NW_PLAN_MAX_BYTES (1 << 20)  /* whole file */
#define NW_PLAN_MAX_LINE 1023        /* bytes per line, without its LF */
#define NW_PLAN_MAX_FIELDS 24        /* blank-separated fields per line */

/* error codes of nw_plan_parse / netweave_plan_check */
enum { NW_PLAN_OK = 0, NW_PLAN_EINVAL = -1 /* not the grammar */, NW_PLAN_ELIMIT = -2 /* a limit above */, NW_PLAN_ENOMEM = -3 };

/* Marking and transport settings of one communicator; NW_UNSET fields are "not given". */
typedef struct {
  int cls;       /* traffic class override (comm/order rules only) */
  int dscp;      /* 0..63 */
  int prio;      /* SO_PRIORITY */
  int64_t rate;  /* bytes/s for the whole connection (split over its data sockets) */
  int nsocks;    /* data sockets per connection */
  int64_t sockchunk; /* bytes per stripe on one data socket */
} nw_mark_t;

enum { NW_SEL_ANY = 0, NW_SEL_CLASS = 1, NW_SEL_COMM = 2, NW_SEL_ORDER = 3 };

typedef struct { int sel; uint64_t id; nw_mark_t m; int line; } nw_comm_rule_t; /* sel COMM or ORDER */
typedef struct {
  int sel; uint64_t id;          /* which communicators */
  int coll;                      /* ncclFunc_t or NW_UNSET */
  uint64_t min_bytes, max_bytes; /* inclusive range (0..UINT64_MAX when not given) */
  int algo, proto, channels;     /* NW_UNSET = leave to NCCL */
  int64_t chunk;
  int has_min, has_max;          /* min=/max= given (for writers that round-trip the text) */
  int line;
} nw_tune_rule_t;
typedef struct { int port; int dscp; int prio; int line; } nw_port_rule_t; /* port NW_UNSET = every TCP socket */

typedef struct {
  int version;
  nw_mark_t cls[NW_NUM_CLASSES];     /* effective: defaults (CSk, prio k) overlaid with the class line */
  nw_mark_t cls_own[NW_NUM_CLASSES]; /* what the class line gave */
  int cls_line[NW_NUM_CLASSES];      /* its line number; 0 = no class line */
  nw_comm_rule_t comm[NW_MAX_RULES]; int ncomm;
  nw_tune_rule_t tune[NW_MAX_RULES]; int ntune;
  nw_port_rule_t port[NW_MAX_RULES]; int nport;
  uint64_t generation; /* bumps on every successful (re)load */
} nw_plan_t;

/* Versioned self-description exported as netweave_plan_info: struct sizes and the grammar's limits. */
typedef struct {
  uint32_t abi, plan_version;
  uint32_t plan_size, mark_size, comm_size, tune_size, port_size;
  uint32_t num_classes, max_rules, max_line, max_fields, max_bytes;
} nw_plan_info_t;

NW_HIDDEN void nw_plan_defaults(nw_plan_t* plan);
/* Parse len bytes of plan text (NUL bytes are an error, not an end). Returns NW_PLAN_OK, or an error
 * code with the message in err and its line in *errline (0 = the file as a whole). */
NW_HIDDEN int nw_plan_parse(const char* text, size_t len, nw_plan_t* plan, char* err, size_t errlen, int* errline);
/* Copy of the current plan ($NETWEAVE_PLAN, re-read when the file changes, checked at most every
 * 100 ms). Without a plan file: the defaults. Returns the generation. */
NW_HIDDEN uint64_t nw_plan_snapshot(nw_plan_t* out);
NW_HIDDEN void nw_mark_clear(nw_mark_t* m);
/* Effective marking of a communicator: class table entry of its class (NCCL's, or the override
 * of a comm/order rule) overlaid with the rule's own fields. */
NW_HIDDEN void nw_plan_resolve(const nw_plan_t* plan, uint64_t commId, int order, int ncclClass, nw_mark_t* out);
NW_HIDDEN int nw_algo_from_name(const char* s);
NW_HIDDEN int nw_proto_from_name(const char* s);
NW_HIDDEN int nw_func_from_name(const char* s);
NW_HIDDEN uint64_t nw_now_ns(void);

/* ------------------------------------------------- communicator registry -- */
/* commId -> (init order in this process, NCCL traffic class, effective class). Filled by the
 * net plugin's per-communicator init; read by the tuner and the profiler. */
NW_HIDDEN int nw_registry_note(uint64_t commId, int ncclClass, int effClass);
NW_HIDDEN int nw_registry_lookup(uint64_t commId, int* order, int* ncclClass, int* effClass);

/* ------------------------------------------------------------- sockets -- */
/* Apply DSCP / SO_PRIORITY / SO_MAX_PACING_RATE (unset fields untouched). Returns 0 or -errno. */
NW_HIDDEN int nw_sock_mark(int fd, int dscp, int prio, int64_t rate);

/* ------------------------------------------------------- profiler ring -- */
enum {
  NW_EV_COLL_START = 1, NW_EV_COLL_STOP = 2, NW_EV_PROXYOP_START = 3, NW_EV_PROXYOP_STOP = 4,
  NW_EV_STEP_START = 5, NW_EV_STEP_STATE = 6, NW_EV_STEP_STOP = 7, NW_EV_NET_SEND = 8, NW_EV_NET_RECV = 9,
  NW_EV_P2P_START = 10, NW_EV_P2P_STOP = 11, NW_EV_USER = 15,
};
typedef struct {
  uint64_t seq;      /* commit marker: ring index + 1, written last */
  uint64_t t_ns;     /* CLOCK_MONOTONIC */
  uint64_t comm_id;
  uint64_t coll_seq; /* collective sequence number (also for its proxy events) */
  uint64_t bytes;
  uint32_t event_id;
  uint32_t parent_id;
  uint16_t kind;
  uint8_t func, algo, proto, channel, is_send;
  int8_t traffic_class;
  int32_t peer;
  int32_t step;      /* proxy step, or the state for NW_EV_STEP_STATE */
} nw_record_t;
_Static_assert(sizeof(nw_record_t) == 64, "ring record is 64 bytes");

#define NW_RING_MAGIC 0x314647505745574eULL /* "NWEWPGF1" little-endian */
#define NW_RING_VERSION 1
#define NW_RING_HEADER 128
typedef struct {
  uint64_t magic;
  uint32_t version, header_size, record_size, capacity;
  uint64_t write_seq; /* records claimed by writers */
  uint64_t read_seq;  /* records consumed by the reader */
  uint64_t dropped;   /* records not written because the ring was full */
  int32_t pid;
  uint32_t flags;
  uint8_t reserved[NW_RING_HEADER - 56];
} nw_ring_header_t;
_Static_assert(sizeof(nw_ring_header_t) == NW_RING_HEADER, "ring header is 128 bytes");

/* error codes of nw_ring_put */
enum { NW_RING_OK = 0, NW_RING_FULL = -1 /* dropped++ */, NW_RING_BAD = -2 /* header no longer what this process mapped */, NW_RING_NONE = -3 };

/* This process's view of its ring: the mapping and the capacity it created, never re-read from
 * the shared header (which any process that can write the file can change). */
typedef struct {
  nw_ring_header_t* h;
  uint64_t capacity; /* power of two */
  size_t bytes;      /* mapped size = NW_RING_HEADER + capacity * sizeof(nw_record_t) */
  int bad;           /* set once the header failed the check: the ring is disabled */
} nw_ring_t;

/* Open (create) the ring named by $NETWEAVE_PROF_RING once per process; NULL when disabled.
 * File rules (ring.c): O_NOFOLLOW, created with O_EXCL; an existing file is reused only when it is
 * a stale netweave ring of this user (one link, no live writer holding its lock). */
NW_HIDDEN nw_ring_t* nw_ring_get(void);
/* Append one record (seq and t_ns are filled in); returns NW_RING_OK, NW_RING_FULL or NW_RING_BAD. */
NW_HIDDEN int nw_ring_put(nw_ring_t* ring, nw_record_t* rec);
NW_HIDDEN uint32_t nw_next_event_id(void);

#endif
