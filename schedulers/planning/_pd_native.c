/* The Phillips-Dessouky iteration of schedulers.planning.pd_core, compiled.
 *
 * Same algorithm, same decisions, same figures as the pure-Python core (see pd_core.py and
 * maxflow.py for the reasoning): incremental longest paths, criticality by zero float, exact
 * integer flow bounds, a warm-started max-flow whose residual reachability gives the smallest
 * minimum cut, lowtime's stop rules but the cost-change one (see pd_core.py). Floating-point
 * work (model cost, energy, longest path with profiled times) is done in the same order as the
 * Python core, so both return the same numbers. schedulers/planning/native.py marshals the arrays.
 *
 * Graph: AON nodes 0..n-1 are instructions, n is a virtual source, n+1 a virtual sink. Arc v
 * (v < n+2) is node v's own arc, vertex 2v -> 2v+1; arc n+2+k is the k-th dependency u -> w,
 * vertex 2u+1 -> 2w. s = 2n (left of the source), t = 2(n+1)+1 (right of the sink).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    /* Input (borrowed). */
    int n, n2, ntables;
    const int32_t *topo_in, *node_table, *t_min, *t_max, *t_doff, *t_ooff, *opt_at;
    const int64_t *lb_tab, *ub_tab;
    const double *cost_tab, *o_time, *o_energy;
    int64_t inf_units;
    double fp_error;
    /* AON graph with source and sink. */
    int *pred_ptr, *pred, *succ_ptr, *succ, *topo, *pos;
    /* Arcs and vertices. */
    int m, nv, s, t;
    int *tails, *heads, *out_ptr, *out_arc, *in_ptr, *in_arc;
    /* Longest paths. */
    int64_t *d, *head, *tail;
    char *dirty;
    /* Flow. */
    int64_t *lb, *ub, *flow, *excess;
    char *active, *now;
    int *unb, nunb, *in_unb;
    long long augmentations;
    /* Search. */
    int *seen, gen, *parent, *queue, *starts;
    signed char *sign;
    /* Evaluation. */
    int *options, *ends, nends;
    int64_t *counts;
    double *rt, *start;
} Ctx;

static void *xcalloc(size_t count, size_t size) {
    return calloc(count ? count : 1, size);
}

static int64_t dur_lb(const Ctx *c, int v) {
    int tb = c->node_table[v];
    return c->lb_tab[c->t_doff[tb] + (c->d[v] - c->t_min[tb])];
}

static int64_t dur_ub(const Ctx *c, int v) {
    int tb = c->node_table[v];
    return c->ub_tab[c->t_doff[tb] + (c->d[v] - c->t_min[tb])];
}

static double dur_cost(const Ctx *c, int v, int64_t dv) {
    int tb = c->node_table[v];
    return c->cost_tab[c->t_doff[tb] + (dv - c->t_min[tb])];
}

static int dur_option(const Ctx *c, int v) {
    int tb = c->node_table[v];
    return c->opt_at[c->t_doff[tb] + (c->d[v] - c->t_min[tb])];
}

/* ---- flow bookkeeping ---- */

static void mark_unbalanced(Ctx *c, int x) {
    if (!c->in_unb[x]) {
        c->in_unb[x] = 1;
        c->unb[c->nunb++] = x;
    }
}

static void shift(Ctx *c, int e, int64_t delta) {
    if (!delta) return;
    c->flow[e] += delta;
    int u = c->tails[e], w = c->heads[e];
    if (u != c->s && u != c->t) {
        c->excess[u] -= delta;
        mark_unbalanced(c, u);
    }
    if (w != c->s && w != c->t) {
        c->excess[w] += delta;
        mark_unbalanced(c, w);
    }
}

static void set_arc(Ctx *c, int e, int on, int64_t lo, int64_t hi) {
    if (!on) {
        c->active[e] = 0;
        shift(c, e, -c->flow[e]);
        return;
    }
    c->active[e] = 1;
    c->lb[e] = lo;
    c->ub[e] = hi;
    int64_t f = c->flow[e], g = f < lo ? lo : f;
    if (g > hi) g = hi;
    shift(c, e, g - f);
}

static void arc_bounds(const Ctx *c, int e, int64_t *lo, int64_t *hi) {
    if (e < c->n) {
        *lo = dur_lb(c, e);
        *hi = dur_ub(c, e);
    } else {
        *lo = 0;
        *hi = c->inf_units;
    }
}

/* Target kinds of a search. */
enum { TO_SINK = 0, TO_TAKER = 1, TO_FREE = 2 };

static int is_target(const Ctx *c, int y, int kind) {
    if (kind == TO_SINK) return y == c->t;
    if (y == c->s || y == c->t) return 1;
    return kind == TO_TAKER && c->excess[y] < 0;
}

/* Breadth-first search of the residual graph from starts; returns the target reached or -1.
 * reverse follows residual arcs against their direction. */
static int search(Ctx *c, const int *starts, int nstarts, int reverse, int kind) {
    int g = ++c->gen, qh = 0, qt = 0;
    for (int i = 0; i < nstarts; i++) {
        int v = starts[i];
        if (c->seen[v] == g) continue;
        c->seen[v] = g;
        c->parent[v] = -1;
        c->queue[qt++] = v;
    }
    const int *a_ptr = reverse ? c->in_ptr : c->out_ptr, *a_arc = reverse ? c->in_arc : c->out_arc;
    const int *b_ptr = reverse ? c->out_ptr : c->in_ptr, *b_arc = reverse ? c->out_arc : c->in_arc;
    const int *a_end = reverse ? c->tails : c->heads, *b_end = reverse ? c->heads : c->tails;
    while (qh < qt) {
        int x = c->queue[qh++];
        for (int k = a_ptr[x]; k < a_ptr[x + 1]; k++) {
            int e = a_arc[k];
            if (!c->active[e] || c->flow[e] >= c->ub[e]) continue;
            int y = a_end[e];
            if (c->seen[y] == g) continue;
            c->seen[y] = g;
            c->parent[y] = e;
            c->sign[y] = 1;
            if (is_target(c, y, kind)) return y;
            c->queue[qt++] = y;
        }
        for (int k = b_ptr[x]; k < b_ptr[x + 1]; k++) {
            int e = b_arc[k];
            if (!c->active[e] || c->flow[e] <= c->lb[e]) continue;
            int y = b_end[e];
            if (c->seen[y] == g) continue;
            c->seen[y] = g;
            c->parent[y] = e;
            c->sign[y] = -1;
            if (is_target(c, y, kind)) return y;
            c->queue[qt++] = y;
        }
    }
    return -1;
}

/* Walk back from end; return the start vertex and the bottleneck; push amount if >= 0. */
static int walk(Ctx *c, int end, int reverse, int64_t *bottleneck, int64_t amount) {
    int x = end;
    int64_t room_min = -1;
    while (c->parent[x] >= 0) {
        int e = c->parent[x];
        int sg = c->sign[x];
        if (amount >= 0) {
            shift(c, e, sg > 0 ? amount : -amount);
        } else {
            int64_t room = sg > 0 ? c->ub[e] - c->flow[e] : c->flow[e] - c->lb[e];
            if (room_min < 0 || room < room_min) room_min = room;
        }
        if (sg > 0) x = reverse ? c->heads[e] : c->tails[e];
        else x = reverse ? c->tails[e] : c->heads[e];
    }
    if (bottleneck) *bottleneck = room_min;
    return x;
}

static void compact_unbalanced(Ctx *c) {
    int k = 0;
    for (int i = 0; i < c->nunb; i++) {
        int x = c->unb[i];
        if (c->excess[x]) c->unb[k++] = x;
        else c->in_unb[x] = 0;
    }
    c->nunb = k;
}

static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* Phase 1: balance every vertex but s and t. Returns 0, or -1 when infeasible. */
static int repair(Ctx *c) {
    for (;;) {
        compact_unbalanced(c);
        int ng = 0;
        for (int i = 0; i < c->nunb; i++)
            if (c->excess[c->unb[i]] > 0) c->starts[ng++] = c->unb[i];
        if (!ng) break;
        qsort(c->starts, ng, sizeof(int), cmp_int);
        int end = search(c, c->starts, ng, 0, TO_TAKER);
        if (end < 0) return -1;
        int64_t room;
        int start = walk(c, end, 0, &room, -1);
        int64_t amount = c->excess[start];
        if (room >= 0 && room < amount) amount = room;
        if (end != c->s && end != c->t && -c->excess[end] < amount) amount = -c->excess[end];
        walk(c, end, 0, NULL, amount);
        c->augmentations++;
    }
    for (;;) {
        compact_unbalanced(c);
        if (!c->nunb) break;
        memcpy(c->starts, c->unb, sizeof(int) * c->nunb);
        qsort(c->starts, c->nunb, sizeof(int), cmp_int);
        int end = search(c, c->starts, c->nunb, 1, TO_FREE);
        if (end < 0) return -1;
        int64_t room;
        int start = walk(c, end, 1, &room, -1);
        int64_t amount = -c->excess[start];
        if (room >= 0 && room < amount) amount = room;
        walk(c, end, 1, NULL, amount);
        c->augmentations++;
    }
    return 0;
}

/* Phases 1-3 (breadth-first augmenting paths here; the Python core uses Dinic level graphs,
 * which finds the same cut); afterwards seen[v] == gen marks the source side. Returns -1 if
 * infeasible. */
static int min_cut(Ctx *c) {
    if (repair(c) < 0) return -1;
    for (;;) {
        int end = search(c, &c->s, 1, 0, TO_SINK);
        if (end < 0) return 0;
        int64_t room;
        walk(c, end, 0, &room, -1);
        walk(c, end, 0, NULL, room);
        c->augmentations++;
    }
}

/* ---- longest paths ---- */

static void propagate(Ctx *c, const int *changed, int nchanged, int forward) {
    const int *n_ptr = forward ? c->succ_ptr : c->pred_ptr, *n_idx = forward ? c->succ : c->pred;
    const int *p_ptr = forward ? c->pred_ptr : c->succ_ptr, *p_idx = forward ? c->pred : c->succ;
    int64_t *val = forward ? c->head : c->tail;
    int len = c->n2, first = len;
    for (int i = 0; i < nchanged; i++) {
        int v = changed[i];
        for (int k = n_ptr[v]; k < n_ptr[v + 1]; k++) {
            int w = n_idx[k];
            c->dirty[w] = 1;
            int kk = forward ? c->pos[w] : len - 1 - c->pos[w];
            if (kk < first) first = kk;
        }
    }
    for (int k = first; k < len; k++) {
        int v = c->topo[forward ? k : len - 1 - k];
        if (!c->dirty[v]) continue;
        c->dirty[v] = 0;
        int64_t best = INT64_MIN;
        for (int j = p_ptr[v]; j < p_ptr[v + 1]; j++) {
            int p = p_idx[j];
            int64_t x = val[p] + c->d[p];
            if (x > best) best = x;
        }
        if (best != val[v]) {
            val[v] = best;
            for (int j = n_ptr[v]; j < n_ptr[v + 1]; j++) c->dirty[n_idx[j]] = 1;
        }
    }
}

static void refresh(Ctx *c, const int *changed, int nchanged) {
    propagate(c, changed, nchanged, 1);
    propagate(c, changed, nchanged, 0);
    int64_t T = c->tail[c->n];
    for (int e = 0; e < c->m; e++) {
        int crit;
        if (e < c->n2) {
            crit = c->head[e] + c->d[e] + c->tail[e] == T;
        } else {
            int u = c->tails[e] / 2, w = c->heads[e] / 2;
            crit = c->head[u] + c->d[u] + c->d[w] + c->tail[w] == T;
        }
        c->now[e] = (char)crit;
    }
    for (int e = 0; e < c->m; e++) {
        if (c->now[e] == c->active[e]) continue;
        int64_t lo, hi;
        arc_bounds(c, e, &lo, &hi);
        set_arc(c, e, c->now[e], lo, hi);
    }
    for (int i = 0; i < nchanged; i++) {
        int v = changed[i];
        if (v < c->n && c->active[v]) set_arc(c, v, 1, dur_lb(c, v), dur_ub(c, v));
    }
}

/* ---- evaluation (plan_eval.PlanEvaluator) ---- */

static void eval_change(Ctx *c, const int *nodes, const int *opts, int count) {
    int n = c->n;
    int first = n;
    for (int i = 0; i < count; i++) {
        int v = nodes[i], tb = c->node_table[v], o = opts[i];
        c->counts[c->t_ooff[tb] + c->options[v]]--;
        c->counts[c->t_ooff[tb] + o]++;
        c->options[v] = o;
        c->rt[v] = c->o_time[c->t_ooff[tb] + o];
        for (int k = c->succ_ptr[v]; k < c->succ_ptr[v + 1]; k++) {
            int w = c->succ[k];
            if (w >= n) continue;
            c->dirty[w] = 1;
            if (c->pos[w] < first) first = c->pos[w];
        }
    }
    for (int k = first; k < c->n2; k++) {
        int v = c->topo[k];
        if (v >= n || !c->dirty[v]) continue;
        c->dirty[v] = 0;
        double best = 0.0;
        int any = 0;
        for (int j = c->pred_ptr[v]; j < c->pred_ptr[v + 1]; j++) {
            int p = c->pred[j];
            if (p >= n) continue;
            double x = c->start[p] + c->rt[p];
            if (!any || x > best) best = x;
            any = 1;
        }
        if (best != c->start[v]) {
            c->start[v] = best;
            for (int j = c->succ_ptr[v]; j < c->succ_ptr[v + 1]; j++)
                if (c->succ[j] < n) c->dirty[c->succ[j]] = 1;
        }
    }
}

static void eval_figures(const Ctx *c, double *energy, double *time_sum, double *makespan) {
    double e = 0.0, ts = 0.0;
    for (int tb = 0; tb < c->ntables; tb++) {
        for (int o = c->t_ooff[tb]; o < c->t_ooff[tb + 1]; o++) {
            if (!c->counts[o]) continue;
            e += (double)c->counts[o] * c->o_energy[o];
            ts += (double)c->counts[o] * c->o_time[o];
        }
    }
    double best = 0.0;
    for (int i = 0; i < c->nends; i++) {
        int v = c->ends[i];
        double x = c->start[v] + c->rt[v];
        if (i == 0 || x > best) best = x;
    }
    *energy = e;
    *time_sum = ts;
    *makespan = best;
}

/* ---- growable output ---- */

typedef struct {
    void *data;
    size_t len, cap, item;
} Vec;

static int vec_push(Vec *v, const void *x) {
    if (v->len == v->cap) {
        size_t cap = v->cap ? 2 * v->cap : 256;
        void *p = realloc(v->data, cap * v->item);
        if (!p) return -1;
        v->data = p;
        v->cap = cap;
    }
    memcpy((char *)v->data + v->len * v->item, x, v->item);
    v->len++;
    return 0;
}

/* ---- setup ---- */

static int build(Ctx *c, const int32_t *preds_ptr, const int32_t *preds) {
    int n = c->n, n2 = n + 2, src = n, snk = n + 1;
    c->n2 = n2;
    int *indeg = xcalloc(n2, sizeof(int)), *outdeg = xcalloc(n2, sizeof(int));
    if (!indeg || !outdeg) return -1;
    int ndeps = 0;
    for (int v = 0; v < n; v++) {
        for (int k = preds_ptr[v]; k < preds_ptr[v + 1]; k++) {
            indeg[v]++;
            outdeg[preds[k]]++;
            ndeps++;
        }
    }
    for (int v = 0; v < n; v++) {
        if (!indeg[v]) { indeg[v]++; outdeg[src]++; ndeps++; }
    }
    for (int v = 0; v < n; v++) {
        if (!outdeg[v]) { outdeg[v]++; indeg[snk]++; ndeps++; }
    }
    c->pred_ptr = xcalloc(n2 + 1, sizeof(int));
    c->succ_ptr = xcalloc(n2 + 1, sizeof(int));
    c->pred = xcalloc(ndeps, sizeof(int));
    c->succ = xcalloc(ndeps, sizeof(int));
    if (!c->pred_ptr || !c->succ_ptr || !c->pred || !c->succ) return -1;
    for (int v = 0; v < n2; v++) {
        c->pred_ptr[v + 1] = c->pred_ptr[v] + indeg[v];
        c->succ_ptr[v + 1] = c->succ_ptr[v] + outdeg[v];
    }
    int *pfill = xcalloc(n2, sizeof(int)), *sfill = xcalloc(n2, sizeof(int));
    if (!pfill || !sfill) return -1;
    /* Same order as pd_core._Dag: real predecessors, then the source; successors by node. */
    for (int v = 0; v < n; v++) {
        for (int k = preds_ptr[v]; k < preds_ptr[v + 1]; k++)
            c->pred[c->pred_ptr[v] + pfill[v]++] = preds[k];
    }
    for (int v = 0; v < n; v++) {
        if (preds_ptr[v] == preds_ptr[v + 1]) c->pred[c->pred_ptr[v] + pfill[v]++] = src;
    }
    for (int v = 0; v < n; v++) {
        for (int k = c->pred_ptr[v]; k < c->pred_ptr[v] + pfill[v]; k++) {
            int p = c->pred[k];
            c->succ[c->succ_ptr[p] + sfill[p]++] = v;
        }
    }
    int nends = 0;
    /* Nodes without real successors get the sink. */
    for (int v = 0; v < n; v++) {
        if (sfill[v] == 0) {
            c->succ[c->succ_ptr[v] + sfill[v]++] = snk;
            c->pred[c->pred_ptr[snk] + pfill[snk]++] = v;
            nends++;
        }
    }
    free(indeg); free(outdeg); free(pfill); free(sfill);
    c->ends = xcalloc(nends, sizeof(int));
    if (!c->ends) return -1;
    c->nends = 0;
    for (int v = 0; v < n; v++) {
        int last = c->succ_ptr[v + 1] - 1;
        if (c->succ[last] == snk) c->ends[c->nends++] = v;
    }
    c->topo = xcalloc(n2, sizeof(int));
    c->pos = xcalloc(n2, sizeof(int));
    if (!c->topo || !c->pos) return -1;
    c->topo[0] = src;
    for (int k = 0; k < n; k++) c->topo[k + 1] = c->topo_in[k];
    c->topo[n2 - 1] = snk;
    for (int k = 0; k < n2; k++) c->pos[c->topo[k]] = k;
    /* Arcs. */
    c->m = n2 + ndeps;
    c->nv = 2 * n2;
    c->s = 2 * src;
    c->t = 2 * snk + 1;
    c->tails = xcalloc(c->m, sizeof(int));
    c->heads = xcalloc(c->m, sizeof(int));
    if (!c->tails || !c->heads) return -1;
    for (int v = 0; v < n2; v++) {
        c->tails[v] = 2 * v;
        c->heads[v] = 2 * v + 1;
    }
    int e = n2;
    for (int v = 0; v < n2; v++) {
        for (int k = c->succ_ptr[v]; k < c->succ_ptr[v + 1]; k++) {
            c->tails[e] = 2 * v + 1;
            c->heads[e] = 2 * c->succ[k];
            e++;
        }
    }
    c->out_ptr = xcalloc(c->nv + 1, sizeof(int));
    c->in_ptr = xcalloc(c->nv + 1, sizeof(int));
    c->out_arc = xcalloc(c->m, sizeof(int));
    c->in_arc = xcalloc(c->m, sizeof(int));
    int *ofill = xcalloc(c->nv, sizeof(int)), *ifill = xcalloc(c->nv, sizeof(int));
    if (!c->out_ptr || !c->in_ptr || !c->out_arc || !c->in_arc || !ofill || !ifill) return -1;
    for (e = 0; e < c->m; e++) {
        c->out_ptr[c->tails[e] + 1]++;
        c->in_ptr[c->heads[e] + 1]++;
    }
    for (int x = 0; x < c->nv; x++) {
        c->out_ptr[x + 1] += c->out_ptr[x];
        c->in_ptr[x + 1] += c->in_ptr[x];
    }
    for (e = 0; e < c->m; e++) {
        c->out_arc[c->out_ptr[c->tails[e]] + ofill[c->tails[e]]++] = e;
        c->in_arc[c->in_ptr[c->heads[e]] + ifill[c->heads[e]]++] = e;
    }
    free(ofill); free(ifill);
    c->d = xcalloc(n2, sizeof(int64_t));
    c->head = xcalloc(n2, sizeof(int64_t));
    c->tail = xcalloc(n2, sizeof(int64_t));
    c->dirty = xcalloc(n2, 1);
    c->lb = xcalloc(c->m, sizeof(int64_t));
    c->ub = xcalloc(c->m, sizeof(int64_t));
    c->flow = xcalloc(c->m, sizeof(int64_t));
    c->active = xcalloc(c->m, 1);
    c->now = xcalloc(c->m, 1);
    c->excess = xcalloc(c->nv, sizeof(int64_t));
    c->unb = xcalloc(c->nv, sizeof(int));
    c->in_unb = xcalloc(c->nv, sizeof(int));
    c->seen = xcalloc(c->nv, sizeof(int));
    c->parent = xcalloc(c->nv, sizeof(int));
    c->queue = xcalloc(c->nv, sizeof(int));
    c->starts = xcalloc(c->nv, sizeof(int));
    c->sign = xcalloc(c->nv, 1);
    c->options = xcalloc(n, sizeof(int));
    c->counts = xcalloc(c->t_ooff[c->ntables], sizeof(int64_t));
    c->rt = xcalloc(n, sizeof(double));
    c->start = xcalloc(n, sizeof(double));
    if (!c->d || !c->head || !c->tail || !c->dirty || !c->lb || !c->ub || !c->flow ||
        !c->active || !c->now || !c->excess || !c->unb || !c->in_unb || !c->seen ||
        !c->parent || !c->queue || !c->starts || !c->sign || !c->options || !c->counts ||
        !c->rt || !c->start)
        return -1;
    return 0;
}

static void release(Ctx *c) {
    void *ptrs[] = {c->pred_ptr, c->pred, c->succ_ptr, c->succ, c->topo, c->pos, c->tails,
                    c->heads, c->out_ptr, c->out_arc, c->in_ptr, c->in_arc, c->d, c->head,
                    c->tail, c->dirty, c->lb, c->ub, c->flow, c->excess, c->active, c->now,
                    c->unb, c->in_unb, c->seen, c->parent, c->queue, c->starts, c->sign,
                    c->options, c->ends, c->counts, c->rt, c->start};
    for (size_t i = 0; i < sizeof(ptrs) / sizeof(ptrs[0]); i++) free(ptrs[i]);
}

typedef struct {
    int64_t quant;
    double cost, energy, time_sum, makespan;
    int64_t delta_end;
} Point;

static const char *STOP_NO_FORWARD = "no arc crosses the cut forwards";
static const char *STOP_DUMMY = "a dependency or the source/sink is on the cut";
static const char *STOP_FASTEST = "an instruction on the cut is at its fastest";
static const char *STOP_SLOWEST = "an instruction on the cut is at its slowest";
static const char *STOP_INFEASIBLE = "infeasible";

/* One step. Fills moved (node ids, sorted) and old durations; returns a stop reason or NULL. */
static const char *step(Ctx *c, int *moved, int64_t *old, int *nmoved, int *failed) {
    *nmoved = 0;
    if (min_cut(c) < 0) {
        *failed = 1;
        return STOP_INFEASIBLE;
    }
    int g = c->gen, nspeed = 0;
    /* Arc ids in increasing order: speed-ups first, then slow-downs (as pd_core sorts them). */
    for (int e = 0; e < c->m; e++) {
        if (!c->active[e]) continue;
        int in_t = c->seen[c->tails[e]] == g, in_h = c->seen[c->heads[e]] == g;
        if (in_t && !in_h) nspeed++;
    }
    if (!nspeed) return STOP_NO_FORWARD;
    for (int e = 0; e < c->m; e++) {
        if (!c->active[e]) continue;
        if (!(c->seen[c->tails[e]] == g && c->seen[c->heads[e]] != g)) continue;
        if (e >= c->n) return STOP_DUMMY;
        int tb = c->node_table[e];
        if (c->d[e] - 1 < c->t_min[tb]) return STOP_FASTEST;
    }
    for (int e = 0; e < c->n; e++) {
        if (!c->active[e]) continue;
        if (!(c->seen[c->heads[e]] == g && c->seen[c->tails[e]] != g)) continue;
        int tb = c->node_table[e];
        if (c->d[e] + 1 > c->t_max[tb]) return STOP_SLOWEST;
    }
    int k = 0;
    for (int e = 0; e < c->n; e++) {
        if (!c->active[e]) continue;
        int in_t = c->seen[c->tails[e]] == g, in_h = c->seen[c->heads[e]] == g;
        if (in_t && !in_h) {
            moved[k] = e;
            old[k++] = c->d[e];
            c->d[e]--;
        } else if (in_h && !in_t) {
            moved[k] = e;
            old[k++] = c->d[e];
            c->d[e]++;
        }
    }
    *nmoved = k;
    return NULL;
}

static int get_buffer(PyObject *obj, Py_buffer *view, const char *fmt, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (strcmp(view->format, fmt) != 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected buffer format %s, got %s", name, fmt,
                     view->format);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *list_from_points(const Vec *pts, int field) {
    PyObject *list = PyList_New((Py_ssize_t)pts->len);
    if (!list) return NULL;
    const Point *p = pts->data;
    for (size_t i = 0; i < pts->len; i++) {
        PyObject *x;
        switch (field) {
            case 0: x = PyLong_FromLongLong(p[i].quant); break;
            case 1: x = PyFloat_FromDouble(p[i].cost); break;
            case 2: x = PyFloat_FromDouble(p[i].energy); break;
            case 3: x = PyFloat_FromDouble(p[i].time_sum); break;
            case 4: x = PyFloat_FromDouble(p[i].makespan); break;
            default: x = PyLong_FromLongLong(p[i].delta_end); break;
        }
        if (!x) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, x);
    }
    return list;
}

static PyObject *list_from_ints(const Vec *v) {
    PyObject *list = PyList_New((Py_ssize_t)v->len);
    if (!list) return NULL;
    const int *a = v->data;
    for (size_t i = 0; i < v->len; i++) {
        PyObject *x = PyLong_FromLong(a[i]);
        if (!x) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, x);
    }
    return list;
}

enum { B_PREDS_PTR, B_PREDS, B_TOPO, B_NODE_TABLE, B_TMIN, B_TMAX, B_TDOFF, B_TOOFF, B_LB,
       B_UB, B_COST, B_OPTAT, B_OTIME, B_OENERGY, NBUF };

static PyObject *pd_solve(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[NBUF], *progress;
    int n, ntables, every;
    long long inf_units;
    double fp_error;
    if (!PyArg_ParseTuple(args, "iiOOOOOOOOOOOOOOLdOi", &n, &ntables, &objs[0], &objs[1],
                          &objs[2], &objs[3], &objs[4], &objs[5], &objs[6], &objs[7],
                          &objs[8], &objs[9], &objs[10], &objs[11], &objs[12], &objs[13],
                          &inf_units, &fp_error, &progress, &every))
        return NULL;
    static const char *fmts[NBUF] = {"i", "i", "i", "i", "i", "i", "i", "i",
                                     "q", "q", "d", "i", "d", "d"};
    static const char *names[NBUF] = {"preds_ptr", "preds", "topo", "node_table", "t_min",
                                      "t_max", "t_doff", "t_ooff", "lb", "ub", "cost",
                                      "option_at", "o_time", "o_energy"};
    Py_buffer views[NBUF];
    int got = 0;
    for (; got < NBUF; got++)
        if (get_buffer(objs[got], &views[got], fmts[got], names[got]) < 0) break;
    PyObject *result = NULL;
    Ctx c;
    memset(&c, 0, sizeof(c));
    Vec pts = {NULL, 0, 0, sizeof(Point)}, dnodes = {NULL, 0, 0, sizeof(int)},
        dopts = {NULL, 0, 0, sizeof(int)};
    int *moved = NULL, *mv_nodes = NULL, *mv_opts = NULL;
    int64_t *old = NULL;
    const char *stop = NULL;
    int failed = 0;
    if (got < NBUF) goto done;
    c.n = n;
    c.ntables = ntables;
    c.topo_in = views[B_TOPO].buf;
    c.node_table = views[B_NODE_TABLE].buf;
    c.t_min = views[B_TMIN].buf;
    c.t_max = views[B_TMAX].buf;
    c.t_doff = views[B_TDOFF].buf;
    c.t_ooff = views[B_TOOFF].buf;
    c.lb_tab = views[B_LB].buf;
    c.ub_tab = views[B_UB].buf;
    c.cost_tab = views[B_COST].buf;
    c.opt_at = views[B_OPTAT].buf;
    c.o_time = views[B_OTIME].buf;
    c.o_energy = views[B_OENERGY].buf;
    c.inf_units = inf_units;
    c.fp_error = fp_error;
    if (build(&c, views[B_PREDS_PTR].buf, views[B_PREDS].buf) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    moved = xcalloc(c.n2, sizeof(int));
    mv_nodes = xcalloc(c.n2, sizeof(int));
    mv_opts = xcalloc(c.n2, sizeof(int));
    old = xcalloc(c.n2, sizeof(int64_t));
    if (!moved || !mv_nodes || !mv_opts || !old) {
        PyErr_NoMemory();
        goto done;
    }
    /* Start: every instruction at its slowest duration. */
    double cost = 0.0;
    for (int v = 0; v < n; v++) {
        int tb = c.node_table[v];
        c.d[v] = c.t_max[tb];
        cost += dur_cost(&c, v, c.d[v]);
        c.options[v] = dur_option(&c, v);
        c.counts[c.t_ooff[tb] + c.options[v]]++;
        c.rt[v] = c.o_time[c.t_ooff[tb] + c.options[v]];
    }
    for (int k = 0; k < c.n2; k++) {
        int v = c.topo[k];
        int64_t best = 0;
        for (int j = c.pred_ptr[v]; j < c.pred_ptr[v + 1]; j++) {
            int p = c.pred[j];
            if (c.head[p] + c.d[p] > best) best = c.head[p] + c.d[p];
        }
        c.head[v] = best;
        if (v < n) {
            double sb = 0.0;
            int any = 0;
            for (int j = c.pred_ptr[v]; j < c.pred_ptr[v + 1]; j++) {
                int p = c.pred[j];
                if (p >= n) continue;
                double x = c.start[p] + c.rt[p];
                if (!any || x > sb) sb = x;
                any = 1;
            }
            c.start[v] = sb;
        }
    }
    for (int k = c.n2 - 1; k >= 0; k--) {
        int v = c.topo[k];
        int64_t best = 0;
        for (int j = c.succ_ptr[v]; j < c.succ_ptr[v + 1]; j++) {
            int w = c.succ[j];
            if (c.d[w] + c.tail[w] > best) best = c.d[w] + c.tail[w];
        }
        c.tail[v] = best;
    }
    Point pt;
    pt.quant = c.tail[n];
    pt.cost = cost;
    eval_figures(&c, &pt.energy, &pt.time_sum, &pt.makespan);
    pt.delta_end = 0;
    if (vec_push(&pts, &pt) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    if (progress != Py_None) {
        PyObject *r = PyObject_CallFunction(progress, "nL", (Py_ssize_t)0, (long long)pt.quant);
        if (!r) goto done;
        Py_DECREF(r);
    }
    refresh(&c, NULL, 0);
    for (;;) {
        int nmoved = 0;
        int chunk = 0;
        int oom = 0;
        Py_BEGIN_ALLOW_THREADS
        for (;;) {
            stop = step(&c, moved, old, &nmoved, &failed);
            if (stop) break;
            int nmv = 0;
            for (int i = 0; i < nmoved; i++) {
                int v = moved[i];
                cost += dur_cost(&c, v, c.d[v]) - dur_cost(&c, v, old[i]);
                int o = dur_option(&c, v);
                if (o != c.options[v]) {
                    mv_nodes[nmv] = v;
                    mv_opts[nmv++] = o;
                }
            }
            for (int i = 0; i < nmv; i++) {
                if (vec_push(&dnodes, &mv_nodes[i]) < 0 || vec_push(&dopts, &mv_opts[i]) < 0)
                    oom = 1;
            }
            eval_change(&c, mv_nodes, mv_opts, nmv);
            refresh(&c, moved, nmoved);
            pt.quant = c.tail[n];
            pt.cost = cost;
            eval_figures(&c, &pt.energy, &pt.time_sum, &pt.makespan);
            pt.delta_end = (int64_t)dnodes.len;
            if (vec_push(&pts, &pt) < 0) oom = 1;
            if (oom || (every > 0 && ++chunk >= every)) break;
        }
        Py_END_ALLOW_THREADS
        if (oom) {
            PyErr_NoMemory();
            goto done;
        }
        if (progress != Py_None) {
            PyObject *r = PyObject_CallFunction(progress, "nL", (Py_ssize_t)(pts.len - 1),
                                                (long long)pt.quant);
            if (!r) goto done;
            Py_DECREF(r);
        }
        if (stop) break;
    }
    {
        PyObject *quants = list_from_points(&pts, 0), *costs = list_from_points(&pts, 1),
                 *energies = list_from_points(&pts, 2), *tsums = list_from_points(&pts, 3),
                 *spans = list_from_points(&pts, 4), *ends = list_from_points(&pts, 5),
                 *nodes = list_from_ints(&dnodes), *opts = list_from_ints(&dopts);
        Vec init = {NULL, 0, 0, sizeof(int)};
        PyObject *initial = NULL;
        int ok = quants && costs && energies && tsums && spans && ends && nodes && opts;
        if (ok) {
            /* Every instruction starts at its slowest duration. */
            init.data = xcalloc(n, sizeof(int));
            if (init.data) {
                int *first = init.data;
                init.len = (size_t)n;
                for (int v = 0; v < n; v++) {
                    int tb = c.node_table[v];
                    first[v] = c.opt_at[c.t_doff[tb] + (c.t_max[tb] - c.t_min[tb])];
                }
                initial = list_from_ints(&init);
                free(init.data);
            }
        }
        if (ok && initial) {
            result = Py_BuildValue("(NNNNNNNNNsL)", quants, costs, energies, tsums, spans,
                                   ends, nodes, opts, initial, failed ? STOP_INFEASIBLE : stop,
                                   (long long)c.augmentations);
        } else {
            Py_XDECREF(quants); Py_XDECREF(costs); Py_XDECREF(energies); Py_XDECREF(tsums);
            Py_XDECREF(spans); Py_XDECREF(ends); Py_XDECREF(nodes); Py_XDECREF(opts);
            Py_XDECREF(initial);
            if (!PyErr_Occurred()) PyErr_NoMemory();
        }
    }
done:
    free(moved); free(mv_nodes); free(mv_opts); free(old);
    free(pts.data); free(dnodes.data); free(dopts.data);
    release(&c);
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"solve", pd_solve, METH_VARARGS,
     "solve(n, ntables, preds_ptr, preds, topo, node_table, t_min, t_max, t_doff, t_ooff, lb, "
     "ub, cost, option_at, o_time, o_energy, inf_units, fp_error, progress, every) -> tuple\n\n"
     "Run the Phillips-Dessouky iteration; see schedulers/planning/native.py."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_pd_native",
    .m_doc = "Compiled Phillips-Dessouky iteration (see pd_core.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__pd_native(void) { return PyModule_Create(&module); }
