/* netweave: the flow-plan grammar, version 1 -- the one parser of plan files.
 *
 * docs/ncclhook.md ("Flow-plan file") states the grammar; the tables below are it. The plugin
 * (plan_load.c), the LD_PRELOAD marker and flowsched.ncclhook.parse_plan (through the exported
 * netweave_plan_check, with ctypes) all parse with this file, so they cannot disagree.
 *
 *   file   : at most NW_PLAN_MAX_BYTES; lines end in LF (a CR at a line's end is accepted); NUL anywhere is an error
 *   line   : at most NW_PLAN_MAX_LINE bytes; '#' starts a comment; outside comments only printable
 *            ASCII, space and tab; fields are separated by spaces/tabs, at most NW_PLAN_MAX_FIELDS
 *   header : "netweave-plan 1", the first statement, once
 *   class <k> [key=value...]     comm <id> [...]     order <n> [...]
 *   tune <*|class:K|comm:ID|order:N> [...]           mark <*|port> [dscp=] [prio=]
 *   numbers: 0 | [1-9][0-9]* | 0x[0-9a-fA-F]+ (no sign, no leading zeros: "010" is an error, not
 *            octal); byte counts also take a k/m/g suffix (x1024); a value out of range is an error
 *   repeats: a key twice on one line and a second `class k` line are errors; comm/order rules for
 *            the same id overlay in file order; tune rules: the first match wins; mark rules: the
 *            first rule for a port wins. At most NW_MAX_RULES comm+order, tune and mark rules each. */
#define _GNU_SOURCE
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nw.h"

/* ---------------------------------------------------------------- names -- */
static const char* const algo_names[] = {"tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat"};
static const char* const proto_names[] = {"ll", "ll128", "simple"};
static const char* const func_names[] = {"broadcast", "reduce", "allgather", "reducescatter", "allreduce",
                                         "sendrecv", "send", "recv", "alltoall", "scatter", "gather", "allgatherv"};
#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* lower case without '_' (and without NCCL's "ncclFunc" prefix): "AllReduce", "ncclFuncAllReduce",
 * "all_reduce" and "allreduce" are one name; -1 when longer than the buffer */
static int fold(const char* s, char* buf, size_t n) {
  size_t j = 0;
  if (strncmp(s, "ncclFunc", 8) == 0) s += 8;
  for (; *s != '\0'; s++) {
    if (*s == '_') continue;
    if (j + 1 >= n) return -1;
    buf[j++] = (char)((*s >= 'A' && *s <= 'Z') ? *s + 32 : *s);
  }
  buf[j] = '\0';
  return 0;
}

static int index_of(const char* s, const char* const* names, int n) {
  char a[32], b[32];
  if (s == NULL || fold(s, a, sizeof(a)) != 0) return NW_UNSET;
  for (int i = 0; i < n; i++)
    if (fold(names[i], b, sizeof(b)) == 0 && strcmp(a, b) == 0) return i;
  return NW_UNSET;
}
int nw_algo_from_name(const char* s) { return index_of(s, algo_names, COUNT(algo_names)); }
int nw_proto_from_name(const char* s) { return index_of(s, proto_names, COUNT(proto_names)); }
int nw_func_from_name(const char* s) { return index_of(s, func_names, COUNT(func_names)); }

/* ---------------------------------------------------------- the tables -- */
enum { S_CLASS = 1, S_COMM = 2 /* comm and order */, S_TUNE = 4, S_MARK = 8 };
enum { V_INT, V_SIZE, V_COLL, V_ALGO, V_PROTO };
enum { F_DSCP, F_PRIO, F_RATE, F_NSOCKS, F_SOCKCHUNK, F_CLASS, F_COLL, F_MIN, F_MAX, F_ALGO, F_PROTO, F_CHANNELS, F_CHUNK, F_COUNT };

typedef struct {
  const char* name;
  int field;
  unsigned stmts; /* statements that take the key */
  int kind;
  uint64_t lo, hi; /* V_INT, V_SIZE */
} key_spec_t;

/* grammar version 1; `priority` is an alias of `prio` */
static const key_spec_t key_table[] = {
    {"dscp", F_DSCP, S_CLASS | S_COMM | S_MARK, V_INT, 0, 63},
    {"prio", F_PRIO, S_CLASS | S_COMM | S_MARK, V_INT, 0, INT32_MAX},
    {"priority", F_PRIO, S_CLASS | S_COMM | S_MARK, V_INT, 0, INT32_MAX},
    {"rate", F_RATE, S_CLASS | S_COMM, V_SIZE, 0, INT64_MAX},
    {"nsocks", F_NSOCKS, S_CLASS | S_COMM, V_INT, 1, 16},
    {"sockchunk", F_SOCKCHUNK, S_CLASS | S_COMM, V_SIZE, 4096, 1u << 30},
    {"class", F_CLASS, S_COMM, V_INT, 0, NW_NUM_CLASSES - 1},
    {"coll", F_COLL, S_TUNE, V_COLL, 0, 0},
    {"min", F_MIN, S_TUNE, V_SIZE, 0, UINT64_MAX},
    {"max", F_MAX, S_TUNE, V_SIZE, 0, UINT64_MAX},
    {"algo", F_ALGO, S_TUNE, V_ALGO, 0, 0},
    {"proto", F_PROTO, S_TUNE, V_PROTO, 0, 0},
    {"channels", F_CHANNELS, S_TUNE, V_INT, 1, 64},
    {"chunk", F_CHUNK, S_TUNE, V_SIZE, 1, INT64_MAX},
};

static const struct { const char* name; unsigned stmt; } stmt_table[] = {
    {"class", S_CLASS}, {"comm", S_COMM}, {"order", S_COMM}, {"tune", S_TUNE}, {"mark", S_MARK}};

/* selector ranges */
#define ORDER_MAX ((uint64_t)INT32_MAX)
#define PORT_MAX 65535u

NW_EXPORT const nw_plan_info_t netweave_plan_info = {
    NW_PLAN_ABI, NW_PLAN_VERSION, sizeof(nw_plan_t), sizeof(nw_mark_t), sizeof(nw_comm_rule_t), sizeof(nw_tune_rule_t),
    sizeof(nw_port_rule_t), NW_NUM_CLASSES, NW_MAX_RULES, NW_PLAN_MAX_LINE, NW_PLAN_MAX_FIELDS, NW_PLAN_MAX_BYTES};

/* ------------------------------------------------------------ parsing -- */
typedef struct {
  int line;
  char* err;
  size_t errlen;
} parser_t;

__attribute__((format(printf, 3, 4))) static int fail(parser_t* p, int code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (p->err != NULL && p->errlen > 0) vsnprintf(p->err, p->errlen, fmt, ap);
  va_end(ap);
  return code;
}

enum { NUM_OK = 0, NUM_SYNTAX, NUM_ZERO, NUM_BIG };

/* <uint> [k|m|g] (suffix only when allowed); NUM_ZERO for a leading zero, NUM_BIG past 2^64-1 */
static int parse_number(const char* s, int allow_suffix, uint64_t* out) {
  uint64_t v = 0;
  const char* c = s;
  if (c[0] == '0' && (c[1] == 'x' || c[1] == 'X')) {
    c += 2;
    if (*c == '\0') return NUM_SYNTAX;
    int any = 0;
    for (;; c++) {
      int d = (*c >= '0' && *c <= '9') ? *c - '0' : (*c >= 'a' && *c <= 'f') ? *c - 'a' + 10 : (*c >= 'A' && *c <= 'F') ? *c - 'A' + 10 : -1;
      if (d < 0) break;
      if (v > (UINT64_MAX >> 4)) return NUM_BIG;
      v = (v << 4) | (uint64_t)d;
      any = 1;
    }
    if (!any) return NUM_SYNTAX;
  } else {
    if (!(*c >= '0' && *c <= '9')) return NUM_SYNTAX;
    if (c[0] == '0' && c[1] >= '0' && c[1] <= '9') return NUM_ZERO;
    for (; *c >= '0' && *c <= '9'; c++) {
      uint64_t d = (uint64_t)(*c - '0');
      if (v > (UINT64_MAX - d) / 10) return NUM_BIG;
      v = v * 10 + d;
    }
  }
  if (allow_suffix && *c != '\0' && c[1] == '\0') {
    int shift = (*c == 'k' || *c == 'K') ? 10 : (*c == 'm' || *c == 'M') ? 20 : (*c == 'g' || *c == 'G') ? 30 : 0;
    if (shift == 0) return NUM_SYNTAX;
    if (v > (UINT64_MAX >> shift)) return NUM_BIG;
    v <<= shift;
    c++;
  }
  if (*c != '\0') return NUM_SYNTAX;
  *out = v;
  return NUM_OK;
}

/* a number in [lo, hi], or an error naming `what`, the range and why */
static int get_number(parser_t* p, const char* what, const char* s, int allow_suffix, uint64_t lo, uint64_t hi, uint64_t* out) {
  int r = parse_number(s, allow_suffix, out);
  const char* kind = allow_suffix ? "a byte count" : "an integer";
  const char* sfx = allow_suffix ? ", k/m/g = x1024" : "";
  if (r == NUM_ZERO)
    return fail(p, NW_PLAN_EINVAL, "%s must be %s %" PRIu64 "..%" PRIu64 ", got '%s' (no leading zeros: octal is not read)", what, kind, lo,
                hi, s);
  if (r != NUM_OK || *out < lo || *out > hi)
    return fail(p, NW_PLAN_EINVAL, "%s must be %s %" PRIu64 "..%" PRIu64 "%s, got '%s'", what, kind, lo, hi, sfx, s);
  return NW_PLAN_OK;
}

static const char* stmt_keys(unsigned stmt, char* buf, size_t n) {
  size_t j = 0;
  buf[0] = '\0';
  for (int i = 0; i < COUNT(key_table); i++)
    if ((key_table[i].stmts & stmt) && strcmp(key_table[i].name, "priority") != 0)
      j += (size_t)snprintf(buf + j, n - j, "%s%s", j ? ", " : "", key_table[i].name);
  return buf;
}

/* parse the key=value fields of one statement into val[], seen = bitmask of fields given */
static int parse_keys(parser_t* p, const char* stmt_name, unsigned stmt, char** tok, int nt, uint64_t* val, unsigned* seen) {
  char keys[128];
  *seen = 0;
  for (int i = 0; i < nt; i++) {
    char* eq = strchr(tok[i], '=');
    if (eq == NULL) return fail(p, NW_PLAN_EINVAL, "expected key=value, got '%s'", tok[i]);
    *eq = '\0';
    const char *k = tok[i], *v = eq + 1;
    const key_spec_t* spec = NULL;
    for (int j = 0; j < COUNT(key_table) && spec == NULL; j++)
      if (strcmp(key_table[j].name, k) == 0) spec = &key_table[j];
    if (spec == NULL || !(spec->stmts & stmt))
      return fail(p, NW_PLAN_EINVAL, "unknown key '%s' for %s (%s)", k, stmt_name, stmt_keys(stmt, keys, sizeof(keys)));
    if (*seen & (1u << spec->field)) return fail(p, NW_PLAN_EINVAL, "key '%s' given twice", k);
    *seen |= 1u << spec->field;
    int idx;
    switch (spec->kind) {
      case V_INT:
      case V_SIZE:
        if (get_number(p, k, v, spec->kind == V_SIZE, spec->lo, spec->hi, &val[spec->field]) != 0) return NW_PLAN_EINVAL;
        break;
      case V_COLL:
        if ((idx = nw_func_from_name(v)) == NW_UNSET) return fail(p, NW_PLAN_EINVAL, "unknown collective '%s'", v);
        val[spec->field] = (uint64_t)idx;
        break;
      case V_ALGO:
        if ((idx = nw_algo_from_name(v)) == NW_UNSET)
          return fail(p, NW_PLAN_EINVAL, "unknown algorithm '%s' (tree, ring, collnet_direct, collnet_chain, nvls, nvls_tree, pat)", v);
        val[spec->field] = (uint64_t)idx;
        break;
      default: /* V_PROTO */
        if ((idx = nw_proto_from_name(v)) == NW_UNSET) return fail(p, NW_PLAN_EINVAL, "unknown protocol '%s' (ll, ll128, simple)", v);
        val[spec->field] = (uint64_t)idx;
        break;
    }
  }
  return NW_PLAN_OK;
}

static void mark_from_keys(const uint64_t* val, unsigned seen, nw_mark_t* m) {
  nw_mark_clear(m);
  if (seen & (1u << F_CLASS)) m->cls = (int)val[F_CLASS];
  if (seen & (1u << F_DSCP)) m->dscp = (int)val[F_DSCP];
  if (seen & (1u << F_PRIO)) m->prio = (int)val[F_PRIO];
  if (seen & (1u << F_RATE)) m->rate = (int64_t)val[F_RATE];
  if (seen & (1u << F_NSOCKS)) m->nsocks = (int)val[F_NSOCKS];
  if (seen & (1u << F_SOCKCHUNK)) m->sockchunk = (int64_t)val[F_SOCKCHUNK];
}

static int parse_tune_selector(parser_t* p, const char* s, nw_tune_rule_t* r) {
  static const char* const what = "tune selector must be *, class:K, comm:ID or order:N";
  if (strcmp(s, "*") == 0) { r->sel = NW_SEL_ANY; r->id = 0; return NW_PLAN_OK; }
  const char* colon = strchr(s, ':');
  if (colon == NULL) return fail(p, NW_PLAN_EINVAL, "%s, got '%s'", what, s);
  size_t n = (size_t)(colon - s);
  uint64_t hi;
  if (n == 5 && strncmp(s, "class", 5) == 0) { r->sel = NW_SEL_CLASS; hi = NW_NUM_CLASSES - 1; }
  else if (n == 4 && strncmp(s, "comm", 4) == 0) { r->sel = NW_SEL_COMM; hi = UINT64_MAX; }
  else if (n == 5 && strncmp(s, "order", 5) == 0) { r->sel = NW_SEL_ORDER; hi = ORDER_MAX; }
  else return fail(p, NW_PLAN_EINVAL, "%s, got '%s'", what, s);
  char name[8];
  snprintf(name, sizeof(name), "%.*s", (int)n, s);
  return get_number(p, name, colon + 1, 0, 0, hi, &r->id);
}

/* one statement: tok[0] its name, tok[1] its selector, tok[2..] key=value */
static int parse_statement(parser_t* p, nw_plan_t* plan, char** tok, int nt) {
  unsigned stmt = 0;
  for (int i = 0; i < COUNT(stmt_table); i++)
    if (strcmp(tok[0], stmt_table[i].name) == 0) stmt = stmt_table[i].stmt;
  if (stmt == 0) {
    if (strcmp(tok[0], "netweave-plan") == 0) return fail(p, NW_PLAN_EINVAL, "a second header");
    return fail(p, NW_PLAN_EINVAL, "unknown rule '%s' (class, comm, order, tune, mark)", tok[0]);
  }
  if (nt < 2) return fail(p, NW_PLAN_EINVAL, "'%s' needs a selector", tok[0]);
  uint64_t val[F_COUNT] = {0}, id = 0;
  unsigned seen = 0;
  if (stmt == S_CLASS) {
    if (get_number(p, "class", tok[1], 0, 0, NW_NUM_CLASSES - 1, &id) != 0) return NW_PLAN_EINVAL;
    if (plan->cls_line[id] != 0) return fail(p, NW_PLAN_EINVAL, "class %d already given on line %d", (int)id, plan->cls_line[id]);
    if (parse_keys(p, "class", stmt, tok + 2, nt - 2, val, &seen) != 0) return NW_PLAN_EINVAL;
    mark_from_keys(val, seen, &plan->cls_own[id]);
    plan->cls_line[id] = p->line;
  } else if (stmt == S_COMM) {
    int is_comm = strcmp(tok[0], "comm") == 0; /* else "order" */
    if (plan->ncomm == NW_MAX_RULES) return fail(p, NW_PLAN_ELIMIT, "more than %d comm/order rules", NW_MAX_RULES);
    if (get_number(p, is_comm ? "comm id" : "order", tok[1], 0, 0, is_comm ? UINT64_MAX : ORDER_MAX, &id) != 0) return NW_PLAN_EINVAL;
    if (parse_keys(p, tok[0], stmt, tok + 2, nt - 2, val, &seen) != 0) return NW_PLAN_EINVAL;
    nw_comm_rule_t* r = &plan->comm[plan->ncomm++];
    r->sel = is_comm ? NW_SEL_COMM : NW_SEL_ORDER;
    r->id = id;
    r->line = p->line;
    mark_from_keys(val, seen, &r->m);
  } else if (stmt == S_TUNE) {
    if (plan->ntune == NW_MAX_RULES) return fail(p, NW_PLAN_ELIMIT, "more than %d tune rules", NW_MAX_RULES);
    nw_tune_rule_t r;
    memset(&r, 0, sizeof(r));
    if (parse_tune_selector(p, tok[1], &r) != 0 || parse_keys(p, "tune", stmt, tok + 2, nt - 2, val, &seen) != 0) return NW_PLAN_EINVAL;
#define GIVEN(f) (seen & (1u << (f)))
    r.coll = GIVEN(F_COLL) ? (int)val[F_COLL] : NW_UNSET;
    r.algo = GIVEN(F_ALGO) ? (int)val[F_ALGO] : NW_UNSET;
    r.proto = GIVEN(F_PROTO) ? (int)val[F_PROTO] : NW_UNSET;
    r.channels = GIVEN(F_CHANNELS) ? (int)val[F_CHANNELS] : NW_UNSET;
    r.chunk = GIVEN(F_CHUNK) ? (int64_t)val[F_CHUNK] : NW_UNSET;
    r.has_min = GIVEN(F_MIN) != 0;
    r.has_max = GIVEN(F_MAX) != 0;
    r.min_bytes = r.has_min ? val[F_MIN] : 0;
    r.max_bytes = r.has_max ? val[F_MAX] : UINT64_MAX;
#undef GIVEN
    if ((r.algo == NW_UNSET) != (r.proto == NW_UNSET)) return fail(p, NW_PLAN_EINVAL, "give algo and proto together (NCCL takes both or neither)");
    if (r.min_bytes > r.max_bytes) return fail(p, NW_PLAN_EINVAL, "min > max");
    r.line = p->line;
    plan->tune[plan->ntune++] = r;
  } else { /* S_MARK */
    if (plan->nport == NW_MAX_RULES) return fail(p, NW_PLAN_ELIMIT, "more than %d mark rules", NW_MAX_RULES);
    int port = NW_UNSET;
    if (strcmp(tok[1], "*") != 0) {
      if (parse_number(tok[1], 0, &id) != NUM_OK || id < 1 || id > PORT_MAX)
        return fail(p, NW_PLAN_EINVAL, "mark selector must be * or a port 1..%u, got '%s'", PORT_MAX, tok[1]);
      port = (int)id;
    }
    if (parse_keys(p, "mark", stmt, tok + 2, nt - 2, val, &seen) != 0) return NW_PLAN_EINVAL;
    nw_port_rule_t* r = &plan->port[plan->nport++];
    r->port = port;
    r->dscp = (seen & (1u << F_DSCP)) ? (int)val[F_DSCP] : NW_UNSET;
    r->prio = (seen & (1u << F_PRIO)) ? (int)val[F_PRIO] : NW_UNSET;
    r->line = p->line;
  }
  return NW_PLAN_OK;
}

/* the bytes of one line (without its LF): allowed bytes, then blank-separated fields */
static int split_line(parser_t* p, const char* s, size_t len, char* buf, char** tok, int* nt) {
  size_t content = len;
  for (size_t i = 0; i < len; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '\0') return fail(p, NW_PLAN_EINVAL, "NUL byte at column %zu", i + 1);
    if (i < content && c == '#') content = i; /* comment: any byte but NUL up to the LF */
    if (i >= content) continue;
    int ok = (c >= 0x21 && c <= 0x7e) || c == ' ' || c == '\t' || (c == '\r' && i + 1 == len);
    if (!ok) return fail(p, NW_PLAN_EINVAL, "byte 0x%02x at column %zu is not allowed outside a comment (plans are ASCII text)", c, i + 1);
  }
  memcpy(buf, s, content);
  buf[content] = '\0';
  *nt = 0;
  char* save = NULL;
  for (char* t = strtok_r(buf, " \t\r", &save); t != NULL; t = strtok_r(NULL, " \t\r", &save)) {
    if (*nt == NW_PLAN_MAX_FIELDS) return fail(p, NW_PLAN_ELIMIT, "more than %d fields", NW_PLAN_MAX_FIELDS);
    tok[(*nt)++] = t;
  }
  return NW_PLAN_OK;
}

static int parse(parser_t* p, const char* text, size_t len, nw_plan_t* plan) {
  if (len > NW_PLAN_MAX_BYTES) return fail(p, NW_PLAN_ELIMIT, "the plan is %zu bytes, more than %d", len, NW_PLAN_MAX_BYTES);
  int seen_header = 0;
  size_t pos = 0;
  while (pos < len) {
    const char* s = text + pos;
    const char* eol = memchr(s, '\n', len - pos);
    size_t n = eol ? (size_t)(eol - s) : len - pos;
    pos += n + (eol ? 1 : 0);
    p->line++;
    if (n > NW_PLAN_MAX_LINE) return fail(p, NW_PLAN_ELIMIT, "line is %zu bytes, more than %d", n, NW_PLAN_MAX_LINE);
    char buf[NW_PLAN_MAX_LINE + 1];
    char* tok[NW_PLAN_MAX_FIELDS];
    int nt = 0;
    int rc = split_line(p, s, n, buf, tok, &nt);
    if (rc != NW_PLAN_OK) return rc;
    if (nt == 0) continue;
    if (!seen_header) {
      if (strcmp(tok[0], "netweave-plan") != 0 || nt != 2) return fail(p, NW_PLAN_EINVAL, "expected the header 'netweave-plan 1'");
      if (strcmp(tok[1], "1") != 0) return fail(p, NW_PLAN_EINVAL, "unsupported plan version '%s' (this library reads 1)", tok[1]);
      seen_header = 1;
      continue;
    }
    rc = parse_statement(p, plan, tok, nt);
    if (rc != NW_PLAN_OK) return rc;
  }
  if (!seen_header) {
    p->line = 0; /* about the file as a whole */
    return fail(p, NW_PLAN_EINVAL, "empty plan, expected the header 'netweave-plan 1'");
  }
  return NW_PLAN_OK;
}

/* ------------------------------------------------------- plan and marks -- */
void nw_mark_clear(nw_mark_t* m) {
  m->cls = m->dscp = m->prio = m->nsocks = NW_UNSET;
  m->rate = m->sockchunk = NW_UNSET;
}

void nw_plan_defaults(nw_plan_t* plan) {
  memset(plan, 0, sizeof(*plan));
  plan->version = NW_PLAN_VERSION;
  /* trafficClass k -> class selector CSk (DSCP 8k) and SO_PRIORITY k: higher class, more urgent */
  for (int k = 0; k < NW_NUM_CLASSES; k++) {
    nw_mark_clear(&plan->cls[k]);
    nw_mark_clear(&plan->cls_own[k]);
    plan->cls[k].dscp = 8 * k;
    plan->cls[k].prio = k;
  }
}

static void overlay(nw_mark_t* dst, const nw_mark_t* src) {
  if (src->dscp != NW_UNSET) dst->dscp = src->dscp;
  if (src->prio != NW_UNSET) dst->prio = src->prio;
  if (src->rate != NW_UNSET) dst->rate = src->rate;
  if (src->nsocks != NW_UNSET) dst->nsocks = src->nsocks;
  if (src->sockchunk != NW_UNSET) dst->sockchunk = src->sockchunk;
}

int nw_plan_parse(const char* text, size_t len, nw_plan_t* plan, char* err, size_t errlen, int* errline) {
  parser_t p = {0, err, errlen};
  if (err != NULL && errlen > 0) err[0] = '\0';
  nw_plan_defaults(plan);
  int rc = parse(&p, text, len, plan);
  if (errline != NULL) *errline = rc == NW_PLAN_OK ? 0 : p.line;
  if (rc == NW_PLAN_OK)
    for (int k = 0; k < NW_NUM_CLASSES; k++) overlay(&plan->cls[k], &plan->cls_own[k]);
  return rc;
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

/* ------------------------------------------------------------- exports -- */
/* The checker of flowsched.ncclhook.parse_plan (ctypes): parse len bytes into *out (may be NULL).
 * Returns NW_PLAN_OK or an error code; err gets the message, *errline its line (0 = whole file). */
NW_EXPORT int netweave_plan_check(const char* text, size_t len, nw_plan_t* out, char* err, size_t errlen, int* errline) {
  nw_plan_t* plan = out != NULL ? out : malloc(sizeof(*plan));
  if (plan == NULL) return NW_PLAN_ENOMEM;
  int rc = nw_plan_parse(text, len, plan, err, errlen, errline);
  if (plan != out) free(plan);
  return rc;
}

/* Canonical names: table 0 collectives, 1 algorithms, 2 protocols; NULL past the end. */
NW_EXPORT const char* netweave_plan_name(int table, int index) {
  static const struct { const char* const* names; int n; } tables[] = {
      {func_names, COUNT(func_names)}, {algo_names, COUNT(algo_names)}, {proto_names, COUNT(proto_names)}};
  if (table < 0 || table >= COUNT(tables) || index < 0 || index >= tables[table].n) return NULL;
  return tables[table].names[index];
}

/* Exported for tests (ctypes): parse NUL-terminated plan text and resolve one communicator's marks.
 * out = {class, dscp, prio, rate, nsocks, sockchunk} (-1 = unset). Returns 0, or an error code with
 * "line N: message" in err. */
NW_EXPORT int netweave_plan_resolve_text(const char* text, uint64_t commId, int order, int ncclClass, int64_t* out, char* err,
                                         size_t errlen) {
  nw_plan_t* plan = malloc(sizeof(*plan));
  if (plan == NULL) return NW_PLAN_ENOMEM;
  char msg[256];
  int line = 0;
  int rc = nw_plan_parse(text, strlen(text), plan, msg, sizeof(msg), &line);
  if (rc == NW_PLAN_OK) {
    nw_mark_t m;
    nw_plan_resolve(plan, commId, order, ncclClass, &m);
    out[0] = m.cls; out[1] = m.dscp; out[2] = m.prio; out[3] = m.rate; out[4] = m.nsocks; out[5] = m.sockchunk;
  } else if (err != NULL && errlen > 0) {
    snprintf(err, errlen, "line %d: %s", line, msg);
  }
  free(plan);
  return rc;
}
