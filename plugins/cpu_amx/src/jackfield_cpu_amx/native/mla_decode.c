/*
 * Absorbed MLA decode over a paged bfloat16 latent cache, on Intel AMX-BF16 tiles.
 *
 * Built by jackfield_cpu_amx.native_build on first use (no Python or torch headers: the entry
 * point takes raw pointers through ctypes). Two more builds exist for tests only, so that this
 * file is checked on CPUs without the instructions: with -DJF_EMULATE_TILES the four tile
 * operations become plain C on thread-local arrays with the same semantics (bfloat16 pairs,
 * float32 accumulation), and every other line runs as in the AMX build (needs AVX-512-BF16);
 * with -DJF_PORTABLE the AVX-512 intrinsics come from portable_simd.h in plain C as well, so
 * any CPU runs it, with outputs equal bit for bit to the JF_EMULATE_TILES build's.
 *
 * Each query token attends its request's first visible[token] keys. A request's q_len * H query
 * rows (token-major, heads inner) are cut into groups of 16 (one tile height), and its keys into
 * splits of split_keys; a work item is one (request, row group, split). Per chunk of 64 keys:
 *   - scores keys-major: S^T [16 keys x 16 rows] = K [16 keys x 32 dims] x Q^T, where the K tile
 *     is loaded straight from the cache (row stride = one record) and Q^T is packed into bfloat16
 *     pairs once per item;
 *   - float32 online softmax, 16 rows per AVX-512 vector, in base 2;
 *   - P [16 rows x 32 keys] transposed into tiles, the values (first kv_lora_rank columns of the
 *     same records) repacked into key pairs in a per-thread buffer, O [16 x kv_lora_rank]
 *     accumulated in float32 tiles.
 * Splits of one row group are merged through their (max, sum) pairs at the end.
 */
#ifdef JF_PORTABLE
#include "portable_simd.h"
#else
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_ROWS 16
#define TILE_ROW_BYTES 64   /* one tile row: 32 bfloat16 or 16 float32 */
#define TILE_BYTES (TILE_ROWS * TILE_ROW_BYTES)
#define DIMS_PER_KSTEP 32   /* bfloat16 products summed per tile row */
#define CHUNK_KEYS 64       /* keys per softmax step: 4 score tiles, 2 P tiles */
/* Chunks ahead whose records are prefetched into L2 during the value product. On the AMX host
 * (B=16, S=4096, H=16, 4 splits, cache evicted from L3), two runs: 2 ahead 1.49 / 1.56 ms,
 * 1 ahead 1.57 / 1.50, none 1.67 / 1.63 (1 vs 2 ahead is within noise). With the cache in L3,
 * none was 0.07-0.1 ms faster than either (PERF_NOTES.md, round 2). */
#define PREFETCH_CHUNKS_AHEAD 2
#define PAIRS_PER_PTILE 16  /* key pairs (32 keys) per P tile */
#define CACHE_LINE 64

/* ---- the tile operations: AMX, or their emulation ------------------------------------------ */

#if defined(JF_EMULATE_TILES) || defined(JF_PORTABLE)

typedef struct {
    _Alignas(64) uint8_t row[TILE_ROWS][TILE_ROW_BYTES];
} emulated_tile;

static _Thread_local emulated_tile emulated_tiles[8];

static void tile_load(int t, const void *base, size_t stride) {
    for (int r = 0; r < TILE_ROWS; r++) memcpy(emulated_tiles[t].row[r], (const char *)base + r * stride, TILE_ROW_BYTES);
}

static void tile_store(int t, void *base, size_t stride) {
    for (int r = 0; r < TILE_ROWS; r++) memcpy((char *)base + r * stride, emulated_tiles[t].row[r], TILE_ROW_BYTES);
}

static float bf16_bits_to_float(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* TDPBF16PS: C[m][n] += sum_k A[m][2k] * B[k][2n] + A[m][2k+1] * B[k][2n+1], in float32. */
static void tile_dpbf16ps(int c, int a, int b) {
    for (int m = 0; m < TILE_ROWS; m++) {
        for (int n = 0; n < TILE_ROW_BYTES / 4; n++) {
            float acc;
            memcpy(&acc, &emulated_tiles[c].row[m][4 * n], sizeof acc);
            for (int k = 0; k < TILE_ROWS; k++) {
                uint16_t a_pair[2], b_pair[2];
                memcpy(a_pair, &emulated_tiles[a].row[m][4 * k], sizeof a_pair);
                memcpy(b_pair, &emulated_tiles[b].row[k][4 * n], sizeof b_pair);
                acc += bf16_bits_to_float(a_pair[0]) * bf16_bits_to_float(b_pair[0]);
                acc += bf16_bits_to_float(a_pair[1]) * bf16_bits_to_float(b_pair[1]);
            }
            memcpy(&emulated_tiles[c].row[m][4 * n], &acc, sizeof acc);
        }
    }
}

#define TILE_LOAD(t, base, stride) tile_load(t, base, stride)
#define TILE_STORE(t, base, stride) tile_store(t, base, stride)
#define TILE_ZERO(t) memset(&emulated_tiles[t], 0, sizeof emulated_tiles[t])
#define TILE_DP(c, a, b) tile_dpbf16ps(c, a, b)
#define TILES_CONFIGURE()
#define TILES_RELEASE()

#else

#define COMPILER_BARRIER() __asm__ volatile("" ::: "memory")

typedef struct __attribute__((packed)) {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tile configuration is per-thread state: every thread of the parallel region loads its own. */
static void tiles_configure(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = TILE_ROW_BYTES;
        config.rows[t] = TILE_ROWS;
    }
    COMPILER_BARRIER(); /* ldtilecfg's asm declares only 8 of the 64 bytes as its input */
    _tile_loadconfig(&config);
}

/* GCC's tileloadd asm declares no memory input: the barrier makes the buffer writes before it land
 * first. tilestored's asm clobbers memory itself. */
#define TILE_LOAD(t, base, stride) \
    do {                           \
        COMPILER_BARRIER();        \
        _tile_loadd(t, base, stride); \
    } while (0)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILES_CONFIGURE() tiles_configure()
#define TILES_RELEASE() _tile_release()

#endif

/* Tile registers (plain numbers: the AMX intrinsics paste them into assembly). Scores:
 * accumulators 0-3 (16 keys each), the packed query 4, keys 5. P x V: accumulators 0-3 (16
 * output columns each), P tiles 4-5, value tiles 6-7 (alternating, so that a load need not wait
 * for the product that reads the other one). */
#define SCORE_Q 4
#define SCORE_K 5
#define PV_P0 4
#define PV_P1 5
#define PV_V0 6
#define PV_V1 7

/* ---- the problem ----------------------------------------------------------------------------- */

typedef uint16_t bf16;

typedef struct {
    const bf16 *query;          /* [num_reqs * q_len * num_heads, width] */
    const bf16 *kv_cache;       /* [num_blocks * block_size, width] */
    const int32_t *block_table; /* [num_reqs, table_stride] */
    const int32_t *seq_lens;    /* [num_reqs] */
    const int32_t *visible;     /* [num_reqs * q_len]: keys the rows of each query token see */
    bf16 *out;                  /* [num_reqs * q_len * num_heads, kv_lora_rank] */
    float *lse;                 /* [num_reqs * q_len * num_heads], natural log */
    int64_t table_stride;
    int num_reqs, q_len, num_heads, kv_lora_rank, width, block_size, num_splits, split_keys;
    float scale_log2;           /* softmax scale times log2(e): scores go to base 2 */
    int row_groups;             /* per request */
    int value_tiles;            /* kv_lora_rank / 16: output column tiles */
} problem;

/* Per-thread buffers, each 64-byte aligned. */
typedef struct {
    uint32_t *q_pairs;  /* [width / 32][16 pairs of dims][16 rows]: the B tiles of the scores */
    float *scores;      /* [CHUNK_KEYS][16 rows] */
    uint32_t *p_pairs;  /* [2][16 rows][16 key pairs]: the A tiles of P x V */
    bf16 *v_pairs;      /* [2][value_tiles][16 key pairs][32]: the B tiles of P x V */
    float *acc;         /* [16 rows][kv_lora_rank]: O when the item has no split to merge */
} thread_buffers;

static const bf16 *record(const problem *p, int req, int key) {
    int64_t block = p->block_table[req * p->table_stride + key / p->block_size];
    return p->kv_cache + (block * p->block_size + key % p->block_size) * (int64_t)p->width;
}

/* 2^x for x <= 0: a degree-7 polynomial on the fraction, |error| < 1e-8 relative, scaled by
 * 2^round(x). x below -150, -inf and NaN give exactly 0 (vmaxps returns its second operand when
 * the first is NaN): a masked key (-inf - max) and a row with no key yet (-inf - -inf) get 0. */
static inline __m512 exp2_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
    __m512 whole = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, whole); /* in [-0.5, 0.5] */
    __m512 poly = _mm512_set1_ps(1.525273380405984e-05f);
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.5403530393381606e-04f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.3333558146428443e-03f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(9.618129107628477e-03f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(5.550410866482158e-02f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(2.402265069591007e-01f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(6.931471805599453e-01f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(poly, whole);
}

/* Rows of a 16 x 16 matrix of 32-bit elements, transposed in registers. */
static inline void transpose_16x16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4i + j], 128-bit lane L: column 4L + j of rows 4i..4i+3 */
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* column 4L + j = lane L of u[j], u[4 + j], u[8 + j], u[12 + j] */
    for (int j = 0; j < 4; j++) {
        __m512i low01 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
        __m512i low23 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
        __m512i high01 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
        __m512i high23 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
        r[j] = _mm512_shuffle_i32x4(low01, high01, _MM_SHUFFLE(2, 0, 2, 0));
        r[4 + j] = _mm512_shuffle_i32x4(low01, high01, _MM_SHUFFLE(3, 1, 3, 1));
        r[8 + j] = _mm512_shuffle_i32x4(low23, high23, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + j] = _mm512_shuffle_i32x4(low23, high23, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* The B tiles of the scores: tile s, row k, column n holds dims 32s + 2k and 32s + 2k + 1 of
 * query row n (rows past `rows` are zero); dim pair 16s + k is row k of tile s. */
static void pack_query(const problem *p, const bf16 *rows_start, int rows, uint32_t *q_pairs) {
    int pairs = p->width / 2;
    for (int n = 0; n < TILE_ROWS; n++) {
        const bf16 *row = rows_start + (int64_t)n * p->width;
        for (int pair = 0; pair < pairs; pair++) {
            uint32_t value = 0;
            if (n < rows) memcpy(&value, row + 2 * pair, sizeof value);
            q_pairs[pair * TILE_ROWS + n] = value;
        }
    }
}

/* Value columns leave the key-pair interleave in this order: within each 32 columns, the even
 * 128-bit groups of 4 first, then the odd ones (_mm512_unpacklo/hi_epi16 work per 128-bit lane).
 * A last group of 16 columns is [0-3, 8-11, 4-7, 12-15] likewise. These undo it. */
static inline __m512i unpermute_low_index(void) {
    return _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
}
static inline __m512i unpermute_high_index(void) {
    return _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
}
static inline __m512i unpermute_last16_index(void) {
    return _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* The value B tiles for the chunk's first 2 * pairs keys (k_tile: the records of each 16 keys,
 * consecutive within a block): key pair k of a P tile interleaved column by column; keys at or
 * past `keys` are zero (an unwritten slot may hold NaN, and 0 x NaN is NaN). */
static void pack_values(const problem *p, const bf16 *const *k_tile, int pairs, int keys, bf16 *v_pairs) {
    const int full_groups = p->kv_lora_rank / 32, tiles = p->value_tiles;
    for (int k = 0; k < pairs; k++) {
        const int key = 2 * k;
        const bf16 *even = key < keys ? k_tile[key / TILE_ROWS] + (int64_t)(key % TILE_ROWS) * p->width : NULL;
        const bf16 *odd = key + 1 < keys ? even + p->width : NULL; /* same 16-key tile */
        bf16 *dst = v_pairs + ((int64_t)(k / PAIRS_PER_PTILE) * tiles * TILE_ROWS + k % PAIRS_PER_PTILE) * 32;
        const int64_t tile_stride = TILE_ROWS * 32; /* bf16 elements per tile */
        for (int g = 0; g < full_groups; g++) {
            __m512i a = even ? _mm512_loadu_si512(even + 32 * g) : _mm512_setzero_si512();
            __m512i b = odd ? _mm512_loadu_si512(odd + 32 * g) : _mm512_setzero_si512();
            _mm512_store_si512(dst + (2 * g) * tile_stride, _mm512_unpacklo_epi16(a, b));
            _mm512_store_si512(dst + (2 * g + 1) * tile_stride, _mm512_unpackhi_epi16(a, b));
        }
        if (p->kv_lora_rank % 32) {
            int col = 32 * full_groups;
            __m256i a = even ? _mm256_loadu_si256((const __m256i *)(even + col)) : _mm256_setzero_si256();
            __m256i b = odd ? _mm256_loadu_si256((const __m256i *)(odd + col)) : _mm256_setzero_si256();
            __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(a, b)),
                                              _mm256_unpackhi_epi16(a, b), 1);
            _mm512_store_si512(dst + (int64_t)(tiles - 1) * tile_stride, both);
        }
    }
}

/* Software prefetch of the next chunk's records into L2, spread over the value product. */
typedef struct {
    const char *tile[CHUNK_KEYS / TILE_ROWS]; /* 16 consecutive records each */
    int tiles, next_tile, next_line, lines_per_tile;
} prefetcher;

static void prefetch_some(prefetcher *pf, int lines) {
    for (; lines > 0 && pf->next_tile < pf->tiles; lines--) {
        _mm_prefetch(pf->tile[pf->next_tile] + (int64_t)pf->next_line * CACHE_LINE, _MM_HINT_T1);
        if (++pf->next_line == pf->lines_per_tile) {
            pf->next_line = 0;
            pf->next_tile++;
        }
    }
}

/* One work item: rows [16 * group, +rows) of request `req` over keys [key_begin, key_end).
 * Leaves O (unnormalised, in the value pack's column order) in acc, and per row the running
 * base-2 max and sum in row_max / row_sum (max -inf and sum 0 for a row that saw no key). */
static void attend_item(const problem *p, thread_buffers *buf, int req, int group, int key_begin, int key_end,
                        float *acc, float *row_max, float *row_sum) {
    const int L = p->kv_lora_rank, tiles = p->value_tiles;
    const int64_t first_row = (int64_t)req * p->q_len * p->num_heads + (int64_t)group * TILE_ROWS;
    const int rows = p->q_len * p->num_heads - group * TILE_ROWS < TILE_ROWS
                         ? p->q_len * p->num_heads - group * TILE_ROWS
                         : TILE_ROWS;
    int32_t vis[TILE_ROWS];
    for (int n = 0; n < TILE_ROWS; n++) {
        vis[n] = n < rows ? p->visible[req * p->q_len + (group * TILE_ROWS + n) / p->num_heads] : 0;
    }
    const __m512i visible = _mm512_loadu_si512(vis);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(p->scale_log2);
    __m512 m = neg_inf, l = _mm512_setzero_ps();
    memset(acc, 0, sizeof(float) * TILE_ROWS * L);
    pack_query(p, p->query + first_row * p->width, rows, buf->q_pairs);

    const int ksteps = p->width / DIMS_PER_KSTEP;
    const size_t record_bytes = (size_t)p->width * sizeof(bf16), acc_stride = (size_t)L * sizeof(float);
    const int lines_per_tile = (int)(TILE_ROWS * record_bytes / CACHE_LINE);
    for (int chunk = key_begin; chunk < key_end; chunk += CHUNK_KEYS) {
        const int keys = key_end - chunk < CHUNK_KEYS ? key_end - chunk : CHUNK_KEYS;
        const int key_tiles = (keys + TILE_ROWS - 1) / TILE_ROWS;
        const bf16 *k_tile[4];
        for (int i = 0; i < key_tiles; i++) k_tile[i] = record(p, req, chunk + TILE_ROWS * i);

        /* S^T = K x Q^T, 16 keys per accumulator; tiles past `keys` are neither read nor used. */
        TILE_ZERO(0); TILE_ZERO(1); TILE_ZERO(2); TILE_ZERO(3);
        for (int s = 0; s < ksteps; s++) {
            TILE_LOAD(SCORE_Q, buf->q_pairs + s * TILE_ROWS * 16, TILE_ROW_BYTES);
            const int64_t dims = (int64_t)s * DIMS_PER_KSTEP;
            TILE_LOAD(SCORE_K, k_tile[0] + dims, record_bytes); TILE_DP(0, SCORE_K, SCORE_Q);
            if (key_tiles > 1) { TILE_LOAD(SCORE_K, k_tile[1] + dims, record_bytes); TILE_DP(1, SCORE_K, SCORE_Q); }
            if (key_tiles > 2) { TILE_LOAD(SCORE_K, k_tile[2] + dims, record_bytes); TILE_DP(2, SCORE_K, SCORE_Q); }
            if (key_tiles > 3) { TILE_LOAD(SCORE_K, k_tile[3] + dims, record_bytes); TILE_DP(3, SCORE_K, SCORE_Q); }
        }
        TILE_STORE(0, buf->scores, TILE_ROW_BYTES);
        if (key_tiles > 1) TILE_STORE(1, buf->scores + 1 * TILE_ROWS * 16, TILE_ROW_BYTES);
        if (key_tiles > 2) TILE_STORE(2, buf->scores + 2 * TILE_ROWS * 16, TILE_ROW_BYTES);
        if (key_tiles > 3) TILE_STORE(3, buf->scores + 3 * TILE_ROWS * 16, TILE_ROW_BYTES);

        /* Base-2 logits; a key a row does not see is -inf by assignment (never by adding: an
         * unwritten slot's score may be NaN). Keys past `keys` are -inf. */
        const int pair_tiles = keys > 2 * PAIRS_PER_PTILE ? 2 : 1, padded = 2 * PAIRS_PER_PTILE * pair_tiles;
        __m512 chunk_max = neg_inf;
        for (int t = 0; t < padded; t++) {
            __mmask16 seen = t < keys ? _mm512_cmpgt_epi32_mask(visible, _mm512_set1_epi32(chunk + t)) : 0;
            __m512 x = _mm512_mask_mul_ps(neg_inf, seen, _mm512_load_ps(buf->scores + 16 * t), scale);
            _mm512_store_ps(buf->scores + 16 * t, x);
            chunk_max = _mm512_max_ps(chunk_max, x);
        }
        const __m512 m_new = _mm512_max_ps(m, chunk_max);
        const __mmask16 had_max = _mm512_cmp_ps_mask(m, neg_inf, _CMP_NEQ_OQ);
        const __m512 correction = exp2_nonpositive(_mm512_sub_ps(m, m_new)); /* 0 where m was -inf */
        l = _mm512_mul_ps(l, correction);
        m = m_new;

        /* P = 2^(x - m), rounded to bfloat16 in key pairs, then transposed into A tiles:
         * row n of P tile j holds pairs 16j..16j+15 of row n. */
        const __m512i interleave = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003,
                                                     0x00140004, 0x00150005, 0x00160006, 0x00170007,
                                                     0x00180008, 0x00190009, 0x001a000a, 0x001b000b,
                                                     0x001c000c, 0x001d000d, 0x001e000e, 0x001f000f);
        for (int j = 0; j < pair_tiles; j++) {
            __m512i pairs[PAIRS_PER_PTILE];
            for (int k = 0; k < PAIRS_PER_PTILE; k++) {
                const float *even = buf->scores + 16 * (32 * j + 2 * k);
                __m512 x0 = _mm512_load_ps(even), x1 = _mm512_load_ps(even + 16);
                __m512 p0 = exp2_nonpositive(_mm512_sub_ps(x0, m)), p1 = exp2_nonpositive(_mm512_sub_ps(x1, m));
                l = _mm512_add_ps(l, _mm512_add_ps(p0, p1));
                /* [p0 as bf16 (16), p1 as bf16 (16)] -> 16 pairs (p0[n], p1[n]) */
                __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
                pairs[k] = _mm512_permutexvar_epi16(interleave, halves);
            }
            transpose_16x16(pairs);
            for (int n = 0; n < TILE_ROWS; n++) {
                _mm512_store_si512(buf->p_pairs + (j * TILE_ROWS + n) * 16, pairs[n]);
            }
        }

        /* Rescale O where a row's max moved (rows seeing their first key have O = 0). */
        float corr[TILE_ROWS];
        _mm512_storeu_ps(corr, correction);
        if (_mm512_cmp_ps_mask(correction, _mm512_set1_ps(1.0f), _CMP_NEQ_OQ)) {
            for (int n = 0; n < TILE_ROWS; n++) {
                if (corr[n] == 1.0f || !(had_max >> n & 1)) continue; /* no max yet: O is 0 */
                __m512 c = _mm512_set1_ps(corr[n]);
                float *row = acc + (int64_t)n * L;
                for (int col = 0; col < L; col += 16) _mm512_storeu_ps(row + col, _mm512_mul_ps(_mm512_loadu_ps(row + col), c));
            }
        }

        pack_values(p, k_tile, PAIRS_PER_PTILE * pair_tiles, keys, buf->v_pairs);

        prefetcher pf = {.tiles = 0, .next_tile = 0, .next_line = 0, .lines_per_tile = lines_per_tile};
        const int ahead = chunk + PREFETCH_CHUNKS_AHEAD * CHUNK_KEYS;
        for (int key = ahead; key < key_end && key < ahead + CHUNK_KEYS; key += TILE_ROWS) {
            pf.tile[pf.tiles++] = (const char *)record(p, req, key);
        }
        const int prefetch_per_step = (pf.tiles * lines_per_tile + (tiles + 3) / 4 - 1) / ((tiles + 3) / 4);

        /* O += P x V, four output column tiles at a time. */
        TILE_LOAD(PV_P0, buf->p_pairs, TILE_ROW_BYTES);
        if (pair_tiles > 1) TILE_LOAD(PV_P1, buf->p_pairs + TILE_ROWS * 16, TILE_ROW_BYTES);
        const bf16 *v0 = buf->v_pairs, *v1 = buf->v_pairs + (int64_t)tiles * TILE_ROWS * 32;
        for (int c0 = 0; c0 < tiles; c0 += 4) {
            const int n = tiles - c0 < 4 ? tiles - c0 : 4;
            float *o = acc + 16 * c0;
#define PV_COLUMN(j, v, p_tile, v_tile, load_acc)                                   \
    if (j < n) {                                                                    \
        if (load_acc) TILE_LOAD(j, o + 16 * j, acc_stride);                         \
        TILE_LOAD(v_tile, (v) + (int64_t)(c0 + j) * TILE_ROWS * 32, TILE_ROW_BYTES); \
        TILE_DP(j, p_tile, v_tile);                                                 \
    }
            PV_COLUMN(0, v0, PV_P0, PV_V0, 1) PV_COLUMN(1, v0, PV_P0, PV_V1, 1)
            PV_COLUMN(2, v0, PV_P0, PV_V0, 1) PV_COLUMN(3, v0, PV_P0, PV_V1, 1)
            if (pair_tiles > 1) {
                PV_COLUMN(0, v1, PV_P1, PV_V0, 0) PV_COLUMN(1, v1, PV_P1, PV_V1, 0)
                PV_COLUMN(2, v1, PV_P1, PV_V0, 0) PV_COLUMN(3, v1, PV_P1, PV_V1, 0)
            }
#undef PV_COLUMN
            TILE_STORE(0, o, acc_stride);
            if (n > 1) TILE_STORE(1, o + 16, acc_stride);
            if (n > 2) TILE_STORE(2, o + 32, acc_stride);
            if (n > 3) TILE_STORE(3, o + 48, acc_stride);
            prefetch_some(&pf, prefetch_per_step);
        }
    }
    _mm512_storeu_ps(row_max, m);
    _mm512_storeu_ps(row_sum, l);
}

/* out and lse of rows [16 * group, +rows) of `req`, merged over `parts` partial results
 * (acc[s] in the value pack's column order, row_max / row_sum per part, 16 floats apart). */
static void write_rows(const problem *p, int req, int group, int parts, float *const *acc, const float *row_max,
                       const float *row_sum, float *merged) {
    const int L = p->kv_lora_rank;
    const int64_t first_row = (int64_t)req * p->q_len * p->num_heads + (int64_t)group * TILE_ROWS;
    const int rows = p->q_len * p->num_heads - group * TILE_ROWS < TILE_ROWS
                         ? p->q_len * p->num_heads - group * TILE_ROWS
                         : TILE_ROWS;
    for (int n = 0; n < rows; n++) {
        bf16 *out = p->out + (first_row + n) * L;
        float max = -INFINITY;
        for (int s = 0; s < parts; s++) max = row_max[16 * s + n] > max ? row_max[16 * s + n] : max;
        if (max == -INFINITY) { /* the row sees no key */
            memset(out, 0, sizeof(bf16) * L);
            p->lse[first_row + n] = -INFINITY;
            continue;
        }
        float sum = 0.0f;
        for (int s = 0; s < parts; s++) {
            if (row_max[16 * s + n] != -INFINITY) sum += exp2f(row_max[16 * s + n] - max) * row_sum[16 * s + n];
        }
        memset(merged, 0, sizeof(float) * L);
        for (int s = 0; s < parts; s++) {
            if (row_max[16 * s + n] == -INFINITY) continue; /* its acc row was never written */
            __m512 w = _mm512_set1_ps(exp2f(row_max[16 * s + n] - max) / sum);
            const float *src = acc[s] + (int64_t)n * L;
            for (int col = 0; col < L; col += 16) {
                _mm512_storeu_ps(merged + col, _mm512_fmadd_ps(w, _mm512_loadu_ps(src + col), _mm512_loadu_ps(merged + col)));
            }
        }
        int col = 0;
        for (; col + 32 <= L; col += 32) {
            __m512 x = _mm512_loadu_ps(merged + col), y = _mm512_loadu_ps(merged + col + 16);
            _mm256_storeu_si256((__m256i *)(out + col), (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(x, unpermute_low_index(), y)));
            _mm256_storeu_si256((__m256i *)(out + col + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(x, unpermute_high_index(), y)));
        }
        if (col < L) {
            __m512 x = _mm512_permutexvar_ps(unpermute_last16_index(), _mm512_loadu_ps(merged + col));
            _mm256_storeu_si256((__m256i *)(out + col), (__m256i)_mm512_cvtneps_pbh(x));
        }
        p->lse[first_row + n] = (max + log2f(sum)) * 0.6931471805599453f;
    }
}

static void *aligned_buffer(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* The key range of split `split` for rows of `group`: keys below the most any of its rows sees
 * (at most the request's seq_len), cut at split_keys. Empty when begin >= end. */
static void item_keys(const problem *p, int req, int group, int split, int *begin, int *end) {
    const int first_token = group * TILE_ROWS / p->num_heads;
    const int last_token = ((group + 1) * TILE_ROWS - 1) / p->num_heads < p->q_len - 1
                               ? ((group + 1) * TILE_ROWS - 1) / p->num_heads
                               : p->q_len - 1;
    int most = 0;
    for (int t = first_token; t <= last_token; t++) {
        if (p->visible[req * p->q_len + t] > most) most = p->visible[req * p->q_len + t];
    }
    if (most > p->seq_lens[req]) most = p->seq_lens[req];
    *begin = split * p->split_keys;
    *end = *begin + p->split_keys < most ? *begin + p->split_keys : most;
}

/* Returns 0, or -1 when a buffer could not be allocated. Outputs are then unspecified. */
int jf_mla_decode(const bf16 *query, const bf16 *kv_cache, const int32_t *block_table, int64_t table_stride,
                  const int32_t *seq_lens, const int32_t *visible, int32_t num_reqs, int32_t q_len,
                  int32_t num_heads, int32_t kv_lora_rank, int32_t width, int32_t block_size, int32_t num_splits,
                  int32_t split_keys, float scale, bf16 *out, float *lse, int32_t num_threads) {
    problem p = {
        .query = query, .kv_cache = kv_cache, .block_table = block_table, .seq_lens = seq_lens,
        .visible = visible, .out = out, .lse = lse, .table_stride = table_stride, .num_reqs = num_reqs,
        .q_len = q_len, .num_heads = num_heads, .kv_lora_rank = kv_lora_rank, .width = width,
        .block_size = block_size, .num_splits = num_splits, .split_keys = split_keys,
        .scale_log2 = scale * 1.4426950408889634f,
        .row_groups = (q_len * num_heads + TILE_ROWS - 1) / TILE_ROWS, .value_tiles = kv_lora_rank / 16,
    };
    const int groups = num_reqs * p.row_groups, items = groups * num_splits;
    const size_t acc_floats = (size_t)TILE_ROWS * kv_lora_rank;
    /* Partial results of split items, merged after all items ran. */
    float *part_acc = NULL, *part_stats = NULL;
    if (num_splits > 1) {
        part_acc = aligned_buffer(sizeof(float) * acc_floats * items);
        part_stats = aligned_buffer(sizeof(float) * 2 * TILE_ROWS * items);
        if (!part_acc || !part_stats) {
            free(part_acc);
            free(part_stats);
            return -1;
        }
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        thread_buffers buf = {
            .q_pairs = aligned_buffer(sizeof(uint32_t) * (width / 2) * TILE_ROWS),
            .scores = aligned_buffer(sizeof(float) * CHUNK_KEYS * TILE_ROWS),
            .p_pairs = aligned_buffer(2 * TILE_BYTES),
            .v_pairs = aligned_buffer((size_t)2 * p.value_tiles * TILE_BYTES),
            .acc = aligned_buffer(sizeof(float) * acc_floats),
        };
        float *merged = aligned_buffer(sizeof(float) * kv_lora_rank);
        const int ok = buf.q_pairs && buf.scores && buf.p_pairs && buf.v_pairs && buf.acc && merged;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        TILES_CONFIGURE();
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < items; item++) {
                const int split = item % num_splits, group = item / num_splits % p.row_groups;
                const int req = item / num_splits / p.row_groups;
                int begin, end;
                item_keys(&p, req, group, split, &begin, &end);
                float stats[2 * TILE_ROWS];
                float *acc = num_splits > 1 ? part_acc + acc_floats * item : buf.acc;
                float *row_max = num_splits > 1 ? part_stats + 2 * TILE_ROWS * item : stats;
                float *row_sum = row_max + TILE_ROWS;
                if (begin < end) {
                    attend_item(&p, &buf, req, group, begin, end, acc, row_max, row_sum);
                } else {
                    for (int n = 0; n < TILE_ROWS; n++) row_max[n] = -INFINITY, row_sum[n] = 0.0f;
                }
                if (num_splits == 1) write_rows(&p, req, group, 1, &acc, row_max, row_sum, merged);
            }
            if (num_splits > 1) {
#pragma omp for schedule(dynamic, 1)
                for (int g = 0; g < groups; g++) {
                    float *accs[num_splits];
                    for (int s = 0; s < num_splits; s++) accs[s] = part_acc + acc_floats * (g * num_splits + s);
                    float row_max[TILE_ROWS * num_splits], row_sum[TILE_ROWS * num_splits];
                    for (int s = 0; s < num_splits; s++) {
                        memcpy(row_max + TILE_ROWS * s, part_stats + 2 * TILE_ROWS * (g * num_splits + s), sizeof(float) * TILE_ROWS);
                        memcpy(row_sum + TILE_ROWS * s, part_stats + 2 * TILE_ROWS * (g * num_splits + s) + TILE_ROWS, sizeof(float) * TILE_ROWS);
                    }
                    write_rows(&p, g / p.row_groups, g % p.row_groups, num_splits, accs, row_max, row_sum, merged);
                }
            }
        }
        TILES_RELEASE();
        free(buf.q_pairs);
        free(buf.scores);
        free(buf.p_pairs);
        free(buf.v_pairs);
        free(buf.acc);
        free(merged);
    }
    free(part_acc);
    free(part_stats);
    return failed ? -1 : 0;
}
