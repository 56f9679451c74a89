/* ggpo's reproducible fp32 matrix product (pipeline/core/gemm.py builds and loads this file).

   C[M, N] = A[M, K] B[K, N], where every element is one fixed sequence of IEEE operations:

       acc = +0;  for k = 0 .. K-1:  acc = fma(A[i, k], B[k, j], acc);  C[i, j] = acc

   fma is the single-rounding fused multiply-add, which every x86 processor with FMA computes
   to the same bits, whatever the vector width it runs at. Everything else here changes only the
   order in which elements are computed, never the sequence of operations of one element:
   register tiles of MR x NR outputs, K in blocks of KC whose partial sums are stored in C and
   read back (fp32 stores and loads are exact), 256-bit (AVX2) or 512-bit (AVX-512F) registers.
   So the result depends on no block size, cache, vendor, vector width or thread count, which
   MKL's vectorized branches do not promise (their sums are split by the processor's dispatch;
   only its SSE2 "COMPATIBLE" branch is documented as the same on every vendor, at a third of
   the speed). A and B are read through strides (in elements), so x W^T of a Linear and both of
   its gradients need no copy before the packing. Compiled with -mavx2 -mfma -ffp-contract=off
   and nothing that lets the compiler reorder floating-point arithmetic (no -ffast-math); the
   512-bit tile is compiled for AVX-512F by a target attribute and runs only where the
   processor has it (ggpo_sgemm checks at run time). */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#define MR 6
#define KC 256

/* B[k0 .. k0+kc, 0 .. N] into panels of nrb columns, each kc x nrb, zero past N. A column-major
   B (sbk == 1: the transposed weight of a Linear) is read a column at a time, contiguously. */
static void pack_b(int kc, int N, int nrb, const float *B, long sbk, long sbn, float *Bp) {
    for (int j0 = 0; j0 < N; j0 += nrb) {
        int nr = N - j0 < nrb ? N - j0 : nrb;
        float *dst = Bp + (long)(j0 / nrb) * kc * nrb;
        if (sbk == 1 && sbn != 1) {
            for (int j = 0; j < nrb; j++) {
                const float *src = B + (j0 + j) * sbn;
                if (j < nr)
                    for (int k = 0; k < kc; k++) dst[k * nrb + j] = src[k];
                else
                    for (int k = 0; k < kc; k++) dst[k * nrb + j] = 0.0f;
            }
            continue;
        }
        for (int k = 0; k < kc; k++, dst += nrb) {
            const float *src = B + k * sbk + j0 * sbn;
            int j = 0;
            if (sbn == 1) {
                memcpy(dst, src, (size_t)nr * sizeof(float));
                j = nr;
            } else {
                for (; j < nr; j++) dst[j] = src[j * sbn];
            }
            for (; j < nrb; j++) dst[j] = 0.0f;
        }
    }
}

/* A[i0 .. i0+mr, k0 .. k0+kc] as kc x MR, zero past mr rows. */
static void pack_a(int kc, int mr, const float *A, long sam, long sak, float *Ap) {
    for (int k = 0; k < kc; k++) {
        int i = 0;
        for (; i < mr; i++) Ap[k * MR + i] = A[i * sam + k * sak];
        for (; i < MR; i++) Ap[k * MR + i] = 0.0f;
    }
}

/* The tile's starting values: zero (first K block) or the partial sums C holds, in buf [MR, nrb]. */
static void tile_start(float *buf, int nrb, const float *C, long ldc, int mr, int nr, int first) {
    if (first) {
        memset(buf, 0, (size_t)MR * nrb * sizeof(float));
        return;
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < nrb; j++) buf[r * nrb + j] = (r < mr && j < nr) ? C[r * ldc + j] : 0.0f;
}

static void tile_finish(const float *buf, int nrb, float *C, long ldc, int mr, int nr) {
    for (int r = 0; r < mr; r++) memcpy(C + r * ldc, buf + r * nrb, (size_t)nr * sizeof(float));
}

/* One MR x 16 tile over kc values of k, 256-bit registers. The 12 accumulators are named so
   that they stay in registers (an array of them is spilled to memory). */
#define NR2 16
static void tile_avx2(int kc, const float *Ap, const float *Bp, float *C, long ldc, int mr, int nr, int first) {
    float buf[MR * NR2];
    int full = mr == MR && nr == NR2;
    const float *in = C;
    long ld = ldc;
    if (!full || first) {
        tile_start(buf, NR2, C, ldc, mr, nr, first);
        in = buf, ld = NR2;
    }
    __m256 c00 = _mm256_loadu_ps(in + 0 * ld), c01 = _mm256_loadu_ps(in + 0 * ld + 8);
    __m256 c10 = _mm256_loadu_ps(in + 1 * ld), c11 = _mm256_loadu_ps(in + 1 * ld + 8);
    __m256 c20 = _mm256_loadu_ps(in + 2 * ld), c21 = _mm256_loadu_ps(in + 2 * ld + 8);
    __m256 c30 = _mm256_loadu_ps(in + 3 * ld), c31 = _mm256_loadu_ps(in + 3 * ld + 8);
    __m256 c40 = _mm256_loadu_ps(in + 4 * ld), c41 = _mm256_loadu_ps(in + 4 * ld + 8);
    __m256 c50 = _mm256_loadu_ps(in + 5 * ld), c51 = _mm256_loadu_ps(in + 5 * ld + 8);
    for (int k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_loadu_ps(Bp + k * NR2), b1 = _mm256_loadu_ps(Bp + k * NR2 + 8);
        const float *a = Ap + k * MR;
        __m256 ar;
        ar = _mm256_broadcast_ss(a + 0); c00 = _mm256_fmadd_ps(ar, b0, c00); c01 = _mm256_fmadd_ps(ar, b1, c01);
        ar = _mm256_broadcast_ss(a + 1); c10 = _mm256_fmadd_ps(ar, b0, c10); c11 = _mm256_fmadd_ps(ar, b1, c11);
        ar = _mm256_broadcast_ss(a + 2); c20 = _mm256_fmadd_ps(ar, b0, c20); c21 = _mm256_fmadd_ps(ar, b1, c21);
        ar = _mm256_broadcast_ss(a + 3); c30 = _mm256_fmadd_ps(ar, b0, c30); c31 = _mm256_fmadd_ps(ar, b1, c31);
        ar = _mm256_broadcast_ss(a + 4); c40 = _mm256_fmadd_ps(ar, b0, c40); c41 = _mm256_fmadd_ps(ar, b1, c41);
        ar = _mm256_broadcast_ss(a + 5); c50 = _mm256_fmadd_ps(ar, b0, c50); c51 = _mm256_fmadd_ps(ar, b1, c51);
    }
    float *out = full ? C : buf;
    ld = full ? ldc : NR2;
    _mm256_storeu_ps(out + 0 * ld, c00); _mm256_storeu_ps(out + 0 * ld + 8, c01);
    _mm256_storeu_ps(out + 1 * ld, c10); _mm256_storeu_ps(out + 1 * ld + 8, c11);
    _mm256_storeu_ps(out + 2 * ld, c20); _mm256_storeu_ps(out + 2 * ld + 8, c21);
    _mm256_storeu_ps(out + 3 * ld, c30); _mm256_storeu_ps(out + 3 * ld + 8, c31);
    _mm256_storeu_ps(out + 4 * ld, c40); _mm256_storeu_ps(out + 4 * ld + 8, c41);
    _mm256_storeu_ps(out + 5 * ld, c50); _mm256_storeu_ps(out + 5 * ld + 8, c51);
    if (!full) tile_finish(buf, NR2, C, ldc, mr, nr);
}

/* The same tile, MR x 32, in 512-bit registers: per element the same fma sequence. */
#define NR5 32
__attribute__((target("avx512f")))
static void tile_avx512(int kc, const float *Ap, const float *Bp, float *C, long ldc, int mr, int nr, int first) {
    float buf[MR * NR5];
    int full = mr == MR && nr == NR5;
    const float *in = C;
    long ld = ldc;
    if (!full || first) {
        tile_start(buf, NR5, C, ldc, mr, nr, first);
        in = buf, ld = NR5;
    }
    __m512 c00 = _mm512_loadu_ps(in + 0 * ld), c01 = _mm512_loadu_ps(in + 0 * ld + 16);
    __m512 c10 = _mm512_loadu_ps(in + 1 * ld), c11 = _mm512_loadu_ps(in + 1 * ld + 16);
    __m512 c20 = _mm512_loadu_ps(in + 2 * ld), c21 = _mm512_loadu_ps(in + 2 * ld + 16);
    __m512 c30 = _mm512_loadu_ps(in + 3 * ld), c31 = _mm512_loadu_ps(in + 3 * ld + 16);
    __m512 c40 = _mm512_loadu_ps(in + 4 * ld), c41 = _mm512_loadu_ps(in + 4 * ld + 16);
    __m512 c50 = _mm512_loadu_ps(in + 5 * ld), c51 = _mm512_loadu_ps(in + 5 * ld + 16);
    for (int k = 0; k < kc; k++) {
        const __m512 b0 = _mm512_loadu_ps(Bp + k * NR5), b1 = _mm512_loadu_ps(Bp + k * NR5 + 16);
        const float *a = Ap + k * MR;
        __m512 ar;
        ar = _mm512_set1_ps(a[0]); c00 = _mm512_fmadd_ps(ar, b0, c00); c01 = _mm512_fmadd_ps(ar, b1, c01);
        ar = _mm512_set1_ps(a[1]); c10 = _mm512_fmadd_ps(ar, b0, c10); c11 = _mm512_fmadd_ps(ar, b1, c11);
        ar = _mm512_set1_ps(a[2]); c20 = _mm512_fmadd_ps(ar, b0, c20); c21 = _mm512_fmadd_ps(ar, b1, c21);
        ar = _mm512_set1_ps(a[3]); c30 = _mm512_fmadd_ps(ar, b0, c30); c31 = _mm512_fmadd_ps(ar, b1, c31);
        ar = _mm512_set1_ps(a[4]); c40 = _mm512_fmadd_ps(ar, b0, c40); c41 = _mm512_fmadd_ps(ar, b1, c41);
        ar = _mm512_set1_ps(a[5]); c50 = _mm512_fmadd_ps(ar, b0, c50); c51 = _mm512_fmadd_ps(ar, b1, c51);
    }
    float *out = full ? C : buf;
    ld = full ? ldc : NR5;
    _mm512_storeu_ps(out + 0 * ld, c00); _mm512_storeu_ps(out + 0 * ld + 16, c01);
    _mm512_storeu_ps(out + 1 * ld, c10); _mm512_storeu_ps(out + 1 * ld + 16, c11);
    _mm512_storeu_ps(out + 2 * ld, c20); _mm512_storeu_ps(out + 2 * ld + 16, c21);
    _mm512_storeu_ps(out + 3 * ld, c30); _mm512_storeu_ps(out + 3 * ld + 16, c31);
    _mm512_storeu_ps(out + 4 * ld, c40); _mm512_storeu_ps(out + 4 * ld + 16, c41);
    _mm512_storeu_ps(out + 5 * ld, c50); _mm512_storeu_ps(out + 5 * ld + 16, c51);
    if (!full) tile_finish(buf, NR5, C, ldc, mr, nr);
}

typedef void (*tile_fn)(int, const float *, const float *, float *, long, int, int, int);

/* The vector width this process uses: 512 where the processor has AVX-512F (and `width` allows
   it), else 256. The bits are the same either way (the file's first comment); the width only
   sets the speed. */
int ggpo_sgemm_width(int width) {
    __builtin_cpu_init();
    return (width != 256 && __builtin_cpu_supports("avx512f")) ? 512 : 256;
}

/* Floats of B packed for ggpo_sgemm_packed: every K block's panels, one after the other. */
long ggpo_packed_size(int N, int K, int width) {
    int nrb = ggpo_sgemm_width(width) == 512 ? NR5 : NR2;
    return (long)((N + nrb - 1) / nrb) * nrb * K;
}

/* B packed once (Bp: ggpo_packed_size floats) for many products with it: the sampler's weights,
   which a draw reads at every step. */
void ggpo_pack(int N, int K, const float *B, long sbk, long sbn, float *Bp, int width) {
    int nrb = ggpo_sgemm_width(width) == 512 ? NR5 : NR2;
    int panels = (N + nrb - 1) / nrb;
    for (int k0 = 0; k0 < K; k0 += KC) {
        int kc = K - k0 < KC ? K - k0 : KC;
        pack_b(kc, N, nrb, B + k0 * sbk, sbk, sbn, Bp + (long)panels * k0 * nrb);
    }
}

/* C = A B with B given packed (ggpo_pack, the same width); Bp == NULL packs B here. Returns 0,
   or -1 when a packing buffer could not be allocated (C is then untouched). */
static int sgemm(int M, int N, int K, const float *A, long sam, long sak, const float *B, long sbk, long sbn,
                 const float *Bpacked, float *C, long ldc, int width) {
    if (K == 0) {
        for (int i = 0; i < M; i++) memset(C + i * ldc, 0, (size_t)N * sizeof(float));
        return 0;
    }
    int wide = ggpo_sgemm_width(width) == 512;
    int nrb = wide ? NR5 : NR2;
    tile_fn tile = wide ? tile_avx512 : tile_avx2;
    int panels = (N + nrb - 1) / nrb;
    int kcmax = K < KC ? K : KC;
    float *Bp = NULL;
    if (Bpacked == NULL) {
        Bp = aligned_alloc(64, ((size_t)panels * kcmax * nrb * sizeof(float) + 63) / 64 * 64);
        if (Bp == NULL) return -1;
    }
    float *Ap = aligned_alloc(64, ((size_t)kcmax * MR * sizeof(float) + 63) / 64 * 64);
    if (Ap == NULL) {
        free(Bp);
        return -1;
    }
    for (int k0 = 0; k0 < K; k0 += KC) {
        int kc = K - k0 < KC ? K - k0 : KC;
        const float *Bk = Bpacked != NULL ? Bpacked + (long)panels * k0 * nrb : Bp;
        if (Bpacked == NULL) pack_b(kc, N, nrb, B + k0 * sbk, sbk, sbn, Bp);
        for (int i0 = 0; i0 < M; i0 += MR) {
            int mr = M - i0 < MR ? M - i0 : MR;
            pack_a(kc, mr, A + i0 * sam + k0 * sak, sam, sak, Ap);
            for (int p = 0; p < panels; p++) {
                int j0 = p * nrb, nr = N - j0 < nrb ? N - j0 : nrb;
                tile(kc, Ap, Bk + (long)p * kc * nrb, C + i0 * ldc + j0, ldc, mr, nr, k0 == 0);
            }
        }
    }
    free(Bp);
    free(Ap);
    return 0;
}

/* C (row-major, leading dimension ldc) = A B; A read as A[i * sam + k * sak], B as
   B[k * sbk + j * sbn]; width 256 or 512 (ggpo_sgemm_width). Returns 0, or -1 when the
   packing buffers could not be allocated (C is then untouched). */
int ggpo_sgemm(int M, int N, int K, const float *A, long sam, long sak, const float *B, long sbk, long sbn,
               float *C, long ldc, int width) {
    return sgemm(M, N, K, A, sam, sak, B, sbk, sbn, NULL, C, ldc, width);
}

int ggpo_sgemm_packed(int M, int N, int K, const float *A, long sam, long sak, const float *Bp, float *C, long ldc,
                      int width) {
    return sgemm(M, N, K, A, sam, sak, NULL, 0, 0, Bp, C, ldc, width);
}
