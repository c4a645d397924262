/* A decode step of the Llama decoder (one new token per row), computed in float32 over
   weights stored as float16 and a float32 or bfloat16 KV cache; head_dim a multiple of 8.

   A decode step of the 135M model reads every weight once per token, so its speed is the speed
   at which the weights stream from memory; in eager PyTorch it also pays ~25 dispatched ops per
   layer, each a few microseconds and a fork and join of the thread pool. Here a whole run of
   layers is one call: one OpenMP parallel region, the threads meeting at a barrier between the
   stages of each layer, and the weight products read a layout made for one pass over memory.
   engine/native.py builds this file with the machine's C compiler and calls it through ctypes;
   engine/decoder.py holds the same computation in PyTorch, which the tests compare it with.

   Weights are "packed": a matrix [n, k] of float16 (n and k multiples of 8) is stored as
   [n / 8][k / 8][8 rows][8 columns], so the 8 rows of a block are read as one contiguous run.
   Products convert each weight to float32 in registers and accumulate in float32. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 8

typedef struct {
    const uint16_t *qkv, *o, *gate_up, *down; /* packed */
    const float *input_norm, *post_norm;
} Layer;

typedef struct {
    long hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    const Layer *layers;
    const float *cos, *sin; /* [positions, head_dim] */
} Model;

typedef struct {
    float *hidden;          /* [rows, hidden], updated in place */
    long rows;
    const long *positions;  /* [rows] */
    const uint8_t *mask;    /* [rows, columns], 0 on padding; NULL: every column is real */
    long columns;           /* cached columns including this step's */
    void *keys, *values;    /* the cache [layers, rows, kv_heads, capacity, head_dim] */
    long layer_stride, row_stride, head_stride; /* in elements */
    int cache_bfloat16;     /* the cache holds bfloat16 (a bfloat16 model's), else float32 */
    float *scratch;         /* decode_scratch_floats() floats */
    int threads;
} Step;

static inline float sum8(__m256 v) {
    __m128 low = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    low = _mm_add_ps(low, _mm_movehl_ps(low, low));
    return _mm_cvtss_f32(_mm_add_ss(low, _mm_movehdup_ps(low)));
}

static inline __m256 load_half8(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* The hardware prefetcher ramps up anew at each of a step's ~120 small matrices; asking for
   the cache lines 1 KB ahead of the ones being read gained ~5% on a whole step's products. */
#define PREFETCH_HALVES 512

static inline void prefetch_ahead(const uint16_t *block) {
    _mm_prefetch((const char *)(block + PREFETCH_HALVES), _MM_HINT_T0);
    _mm_prefetch((const char *)(block + PREFETCH_HALVES + 32), _MM_HINT_T0);
}

/* out[0, n0 .. n0 + 8] of one input row by one packed block: 8 independent accumulators. */
static void block_one_row(const uint16_t *block, const float *x, long k, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (long c = 0; c < k; c += BLOCK, block += BLOCK * BLOCK) {
        __m256 xv = _mm256_loadu_ps(x + c);
        prefetch_ahead(block);
        a0 = _mm256_fmadd_ps(load_half8(block), xv, a0);
        a1 = _mm256_fmadd_ps(load_half8(block + 8), xv, a1);
        a2 = _mm256_fmadd_ps(load_half8(block + 16), xv, a2);
        a3 = _mm256_fmadd_ps(load_half8(block + 24), xv, a3);
        a4 = _mm256_fmadd_ps(load_half8(block + 32), xv, a4);
        a5 = _mm256_fmadd_ps(load_half8(block + 40), xv, a5);
        a6 = _mm256_fmadd_ps(load_half8(block + 48), xv, a6);
        a7 = _mm256_fmadd_ps(load_half8(block + 56), xv, a7);
    }
    /* Eight horizontal sums at once: after two rounds of pairwise adds, lane j of each half
       holds part of row j's sum (rows 0-3 in t0, 4-7 in t1). */
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                                _mm256_permute2f128_ps(t0, t1, 0x31));
    _mm256_storeu_ps(out, sums);
}

/* out[r, n0 .. n0 + 8] for rows r of x by one packed block: tiles of 4 weight rows by 2 input
   rows; the block (k * 16 bytes) stays in the L1 cache across the tiles. */
static void block_rows(const uint16_t *block, const float *x, long rows, long k, long n,
                       float *out) {
    for (long r = 0; r < rows; r += 2) {
        const float *x0 = x + r * k, *x1 = r + 1 < rows ? x0 + k : x0;
        for (long half = 0; half < BLOCK; half += 4) {
            __m256 acc[4][2];
            for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
            const uint16_t *w = block + half * BLOCK;
            for (long c = 0; c < k; c += BLOCK, w += BLOCK * BLOCK) {
                __m256 xv0 = _mm256_loadu_ps(x0 + c), xv1 = _mm256_loadu_ps(x1 + c);
                if (r == 0 && half == 0) prefetch_ahead(w);
                for (int j = 0; j < 4; j++) {
                    __m256 wv = load_half8(w + j * BLOCK);
                    acc[j][0] = _mm256_fmadd_ps(wv, xv0, acc[j][0]);
                    acc[j][1] = _mm256_fmadd_ps(wv, xv1, acc[j][1]);
                }
            }
            for (int j = 0; j < 4; j++) {
                out[r * n + half + j] = sum8(acc[j][0]);
                if (r + 1 < rows) out[(r + 1) * n + half + j] = sum8(acc[j][1]);
            }
        }
    }
}

/* out [rows, n] = x [rows, k] @ weight.T; weight packed [n, k]. Called inside a parallel
   region: the blocks are shared out among its threads; the caller waits at a barrier. */
static void product(const uint16_t *packed, const float *x, float *out, long rows, long k,
                    long n) {
    long blocks = n / BLOCK;
#pragma omp for schedule(static) nowait
    for (long b = 0; b < blocks; b++) {
        const uint16_t *block = packed + b * BLOCK * k;
        if (rows == 1)
            block_one_row(block, x, k, out + b * BLOCK);
        else
            block_rows(block, x, rows, k, n, out + b * BLOCK);
    }
}

static void rms_norm(const float *x, const float *weight, float *out, long size, float eps) {
    float squares = 0;
    for (long i = 0; i < size; i++) squares += x[i] * x[i];
    float inverse = 1.0f / sqrtf(squares / size + eps);
    for (long i = 0; i < size; i++) out[i] = weight[i] * (x[i] * inverse);
}

static void add_into(float *row, const float *addend, long size) {
    for (long i = 0; i < size; i++) row[i] += addend[i];
}

/* Rotate-half RoPE of one head in place. */
static void rope(float *head, const float *cos, const float *sin, long head_dim) {
    long half = head_dim / 2;
    for (long i = 0; i < half; i++) {
        float first = head[i], second = head[i + half];
        head[i] = first * cos[i] - second * sin[i];
        head[i + half] = second * cos[i + half] + first * sin[i + half];
    }
}

/* 8 cache entries from element `index` of a float32 or a bfloat16 cache, as float32 (a
   bfloat16 is the upper half of a float32). */
static inline __m256 load_cached8(const void *cache, long index, int bfloat16) {
    if (!bfloat16) return _mm256_loadu_ps((const float *)cache + index);
    __m128i halves = _mm_loadu_si128((const __m128i *)((const uint16_t *)cache + index));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

/* `size` floats into a float32 or bfloat16 cache at element `index`; bfloat16 rounded to
   nearest even, as torch's conversion does (the cache holds no NaN worth keeping apart: a
   non-finite step fails its requests). */
static void store_cached(void *cache, long index, const float *values, long size, int bfloat16) {
    if (!bfloat16) {
        memcpy((float *)cache + index, values, size * sizeof(float));
        return;
    }
    uint16_t *out = (uint16_t *)cache + index;
    for (long i = 0; i < size; i++) {
        uint32_t bits;
        memcpy(&bits, &values[i], sizeof bits);
        out[i] = (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
    }
}

/* One query head over its key/value head's cached columns (masked ones skipped), the keys
   and values starting at element `at` of the layer's cache. */
static inline void attend(const Model *m, const Step *s, const float *query, const void *keys,
                          const void *values, long at, const uint8_t *mask, float *scores,
                          float *out, int bfloat16) {
    long d = m->head_dim;
    float highest = -INFINITY;
    for (long c = 0; c < s->columns; c++) {
        if (mask && !mask[c]) continue;
        __m256 sum = _mm256_setzero_ps();
        for (long i = 0; i < d; i += 8)
            sum = _mm256_fmadd_ps(_mm256_loadu_ps(query + i),
                                  load_cached8(keys, at + c * d + i, bfloat16), sum);
        scores[c] = sum8(sum) * m->scale;
        if (scores[c] > highest) highest = scores[c];
    }
    float total = 0;
    for (long i = 0; i < d; i += 8) _mm256_storeu_ps(out + i, _mm256_setzero_ps());
    for (long c = 0; c < s->columns; c++) {
        if (mask && !mask[c]) continue;
        float weight = expf(scores[c] - highest);
        total += weight;
        __m256 weights = _mm256_set1_ps(weight);
        for (long i = 0; i < d; i += 8)
            _mm256_storeu_ps(out + i, _mm256_fmadd_ps(weights,
                                                      load_cached8(values, at + c * d + i, bfloat16),
                                                      _mm256_loadu_ps(out + i)));
    }
    for (long i = 0; i < d; i++) out[i] /= total;
}

long decode_scratch_floats(const Model *m, long rows, long columns) {
    long qkv = (m->heads + 2 * m->kv_heads) * m->head_dim;
    return rows * (2 * m->hidden + qkv + m->heads * m->head_dim + 3 * m->intermediate) +
           rows * m->heads * columns;
}

/* Layers [first, last) of one decode step (one new token per row). */
void decode_layers(const Model *m, const Step *s, long first, long last) {
    long rows = s->rows, hidden = m->hidden, d = m->head_dim, inter = m->intermediate;
    long qkv_size = (m->heads + 2 * m->kv_heads) * d, attention_size = m->heads * d;
    long group = m->heads / m->kv_heads;
    float *normed = s->scratch, *qkv = normed + rows * hidden, *attention = qkv + rows * qkv_size;
    float *mlp = attention + rows * attention_size, *projected = mlp + rows * 2 * inter;
    float *activation = projected + rows * hidden, *scores = activation + rows * inter;
    long column = s->columns - 1;

#pragma omp parallel num_threads(s->threads)
    for (long index = first; index < last; index++) {
        const Layer *layer = &m->layers[index];
        long layer_at = index * s->layer_stride;
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++)
            rms_norm(s->hidden + r * hidden, layer->input_norm, normed + r * hidden, hidden, m->eps);
        product(layer->qkv, normed, qkv, rows, hidden, qkv_size);
#pragma omp barrier
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) {
            float *row = qkv + r * qkv_size;
            const float *cos = m->cos + s->positions[r] * d, *sin = m->sin + s->positions[r] * d;
            for (long h = 0; h < m->heads + m->kv_heads; h++) rope(row + h * d, cos, sin, d);
            for (long g = 0; g < m->kv_heads; g++) {
                long at = layer_at + r * s->row_stride + g * s->head_stride + column * d;
                store_cached(s->keys, at, row + (m->heads + g) * d, d, s->cache_bfloat16);
                store_cached(s->values, at, row + (m->heads + m->kv_heads + g) * d, d,
                             s->cache_bfloat16);
            }
        }
#pragma omp for schedule(static)
        for (long item = 0; item < rows * m->heads; item++) {
            long r = item / m->heads, h = item % m->heads;
            long at = layer_at + r * s->row_stride + (h / group) * s->head_stride;
            const uint8_t *mask = s->mask ? s->mask + r * s->columns : NULL;
            const float *query = qkv + r * qkv_size + h * d;
            float *scores_of_item = scores + item * s->columns;
            float *out = attention + r * attention_size + h * d;
            /* Two copies of attend, each with the cache's type known where it loads. */
            if (s->cache_bfloat16)
                attend(m, s, query, s->keys, s->values, at, mask, scores_of_item, out, 1);
            else
                attend(m, s, query, s->keys, s->values, at, mask, scores_of_item, out, 0);
        }
        product(layer->o, attention, projected, rows, attention_size, hidden);
#pragma omp barrier
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) {
            add_into(s->hidden + r * hidden, projected + r * hidden, hidden);
            rms_norm(s->hidden + r * hidden, layer->post_norm, normed + r * hidden, hidden, m->eps);
        }
        product(layer->gate_up, normed, mlp, rows, hidden, 2 * inter);
#pragma omp barrier
#pragma omp for schedule(static)
        for (long item = 0; item < rows * inter; item++) {
            float gate = mlp[(item / inter) * 2 * inter + item % inter];
            float up = mlp[(item / inter) * 2 * inter + inter + item % inter];
            activation[item] = gate / (1.0f + expf(-gate)) * up;
        }
        product(layer->down, activation, projected, rows, inter, hidden);
#pragma omp barrier
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) add_into(s->hidden + r * hidden, projected + r * hidden, hidden);
    }
}
