// Flotilla's CUDA kernels: one NVRTC translation unit, compiled at run time for the device's
// architecture (src/kernels/cuda/mod.rs). No headers are included, so NVRTC needs nothing but
// libnvrtc: f16 is converted with PTX `cvt`, bf16 with bit operations.
//
// Every kernel has a CPU twin in src/kernels/cuda/twin.rs that follows the same decomposition
// (threads, tiles, reduction order) and is tested against the CPU kernels (src/kernels/cpu/).
// Shapes are row-major, activations f32; the KV pool of one layer is
// [num_blocks, block_size, n_kv_heads, head_dim] f32, as on the CPU (src/model/kv_cache.rs).
//
// Launch shapes are fixed by the host code; THREADS is the block size of every kernel that
// reduces across a block (a multiple of 32).

#define THREADS 256
#define ATT_THREADS 128
#define ATT_MAX_HEAD_DIM 256
#define GEMV_MAX_M 8
#define NEG_INF __int_as_float(0xff800000)

// ---------------------------------------------------------------------------------------------
// Number formats

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// ggml stores f16 scales little-endian at 2-byte-aligned offsets inside packed blocks.
__device__ __forceinline__ float load_f16(const unsigned char* p) {
    return f16_to_f32((unsigned short)(p[0] | (p[1] << 8)));
}

__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// Round to nearest even; NaN stays a (quiet) NaN. Same rule as `half::bf16::from_f32`.
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// Q8_0: 34-byte blocks, f16 d then 32 x i8; x = d*q.
__device__ __forceinline__ float q8_0_at(const unsigned char* blocks, long long i) {
    const unsigned char* b = blocks + (i >> 5) * 34;
    return load_f16(b) * (float)(signed char)b[2 + (i & 31)];
}

// Q4_1: 20-byte blocks, f16 d, f16 m, 16 bytes of nibbles (low nibbles are values 0..15,
// high nibbles 16..31); x = d*q + m.
__device__ __forceinline__ float q4_1_at(const unsigned char* blocks, long long i) {
    const unsigned char* b = blocks + (i >> 5) * 20;
    int j = (int)(i & 31);
    unsigned char q = b[4 + (j & 15)];
    q = j < 16 ? (q & 15) : (q >> 4);
    return load_f16(b) * (float)q + load_f16(b + 2);
}

// ---------------------------------------------------------------------------------------------
// Reductions. Warp: butterfly (xor 16, 8, 4, 2, 1). Block: each warp's lane 0 writes its sum,
// warp 0 reduces those the same way, the result is broadcast through shared memory.

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ float block_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < nw ? sh[lane] : 0.0f;
        w = warp_sum(w);
        if (lane == 0) sh[32] = w;
    }
    __syncthreads();
    float r = sh[32];
    __syncthreads();
    return r;
}

__device__ float block_max(float v, float* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < nw ? sh[lane] : NEG_INF;
        w = warp_max(w);
        if (lane == 0) sh[32] = w;
    }
    __syncthreads();
    float r = sh[32];
    __syncthreads();
    return r;
}

// ---------------------------------------------------------------------------------------------
// Element-wise ops

// out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w.  grid (rows), block THREADS.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int d, float eps) {
    __shared__ float sh[33];
    const float* xr = x + (long long)blockIdx.x * d;
    float* o = out + (long long)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, sh);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = xr[i] * inv * w[i];
}

// Rotary embedding in place on x[t, heads, head_dim] at positions[t]; angles in f64 as on the
// CPU (a = pos * inv_freq[i]). interleaved: pairs (2i, 2i+1) (GGUF); else (i, i+half) (HF).
// grid (tokens), block THREADS.
extern "C" __global__ void rope(float* x, const int* positions, const double* inv_freq,
                                int heads, int head_dim, int half, int interleaved) {
    float* xt = x + (long long)blockIdx.x * heads * head_dim;
    double pos = (double)positions[blockIdx.x];
    for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
        int h = j / half, i = j % half;
        double a = pos * inv_freq[i];
        float c = (float)cos(a), s = (float)sin(a);
        int ia = interleaved ? 2 * i : i;
        int ib = interleaved ? 2 * i + 1 : i + half;
        float* hp = xt + h * head_dim;
        float x0 = hp[ia], x1 = hp[ib];
        hp[ia] = x0 * c - x1 * s;
        hp[ib] = x0 * s + x1 * c;
    }
}

// gate = silu(gate) * up, n elements.  grid-stride.
extern "C" __global__ void swiglu(float* gate, const float* up, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// x += y (the residual stream), n elements.  grid-stride.
extern "C" __global__ void add(float* x, const float* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] += y[i];
    }
}

// x[r, c] += b[c] for rows of width d (q/k/v projection biases).  grid-stride over r*d.
extern "C" __global__ void add_bias(float* x, const float* b, long long n, int d) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] += b[i % d];
    }
}

// ---------------------------------------------------------------------------------------------
// Embedding gather: out[t, :] = table[tokens[t], :] dequantised.  grid (tokens), block THREADS.

extern "C" __global__ void embed_f32(const float* table, const unsigned int* tokens, float* out,
                                     int cols) {
    long long base = (long long)tokens[blockIdx.x] * cols;
    float* o = out + (long long)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = table[base + i];
}

extern "C" __global__ void embed_q8_0(const unsigned char* table, const unsigned int* tokens,
                                      float* out, int cols) {
    long long base = (long long)tokens[blockIdx.x] * cols;
    float* o = out + (long long)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = q8_0_at(table, base + i);
}

extern "C" __global__ void embed_q4_1(const unsigned char* table, const unsigned int* tokens,
                                      float* out, int cols) {
    long long base = (long long)tokens[blockIdx.x] * cols;
    float* o = out + (long long)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = q4_1_at(table, base + i);
}

// ---------------------------------------------------------------------------------------------
// Dequantisation to bf16 (weights for cuBLAS) and f32 -> bf16 (activations).  grid-stride.

extern "C" __global__ void dequant_q8_0_bf16(const unsigned char* w, unsigned short* out,
                                             long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = f32_to_bf16(q8_0_at(w, i));
    }
}

extern "C" __global__ void dequant_q4_1_bf16(const unsigned char* w, unsigned short* out,
                                             long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = f32_to_bf16(q4_1_at(w, i));
    }
}

extern "C" __global__ void f32_to_bf16_n(const float* x, unsigned short* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = f32_to_bf16(x[i]);
    }
}

// ---------------------------------------------------------------------------------------------
// Decode matrix-vector products with on-the-fly dequantisation: y[r, row] = x[r, :] . W[row, :]
// for r < m <= GEMV_MAX_M. One warp per output row; lane l takes quant blocks l, l+32, ...;
// the lanes' partial sums are combined with warp_sum. cols is a multiple of 32.
// grid (ceil(rows / (THREADS/32))), block THREADS.

extern "C" __global__ void gemv_q4_1(const unsigned char* w, const float* x, float* y, int rows,
                                     int cols, int m) {
    int row = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    int nb = cols >> 5;
    float acc[GEMV_MAX_M];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_M; r++) acc[r] = 0.0f;
    const unsigned char* wr = w + (long long)row * nb * 20;
    for (int b = lane; b < nb; b += 32) {
        const unsigned char* blk = wr + b * 20;
        float d = load_f16(blk), mn = load_f16(blk + 2);
        for (int j = 0; j < 16; j++) {
            unsigned char q = blk[4 + j];
            float w0 = d * (float)(q & 15) + mn, w1 = d * (float)(q >> 4) + mn;
#pragma unroll
            for (int r = 0; r < GEMV_MAX_M; r++) {
                if (r < m) {
                    const float* xr = x + (long long)r * cols + b * 32;
                    acc[r] += w0 * xr[j] + w1 * xr[j + 16];
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_MAX_M; r++) {
        if (r < m) {
            float s = warp_sum(acc[r]);
            if (lane == 0) y[(long long)r * rows + row] = s;
        }
    }
}

extern "C" __global__ void gemv_q8_0(const unsigned char* w, const float* x, float* y, int rows,
                                     int cols, int m) {
    int row = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    int nb = cols >> 5;
    float acc[GEMV_MAX_M];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_M; r++) acc[r] = 0.0f;
    const unsigned char* wr = w + (long long)row * nb * 34;
    for (int b = lane; b < nb; b += 32) {
        const unsigned char* blk = wr + b * 34;
        float d = load_f16(blk);
        for (int j = 0; j < 32; j++) {
            float wv = d * (float)(signed char)blk[2 + j];
#pragma unroll
            for (int r = 0; r < GEMV_MAX_M; r++) {
                if (r < m) acc[r] += wv * x[(long long)r * cols + b * 32 + j];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_MAX_M; r++) {
        if (r < m) {
            float s = warp_sum(acc[r]);
            if (lane == 0) y[(long long)r * rows + row] = s;
        }
    }
}

extern "C" __global__ void gemv_f32(const float* w, const float* x, float* y, int rows, int cols,
                                    int m) {
    int row = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float acc[GEMV_MAX_M];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_M; r++) acc[r] = 0.0f;
    const float* wr = w + (long long)row * cols;
    for (int c = lane; c < cols; c += 32) {
        float wv = wr[c];
#pragma unroll
        for (int r = 0; r < GEMV_MAX_M; r++) {
            if (r < m) acc[r] += wv * x[(long long)r * cols + c];
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_MAX_M; r++) {
        if (r < m) {
            float s = warp_sum(acc[r]);
            if (lane == 0) y[(long long)r * rows + row] = s;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Paged KV

// k_pool[slots[t] + i] = k[t, i] (and v), i < kvd: the new tokens' K/V into their pool slots.
// grid (tokens), block THREADS.
extern "C" __global__ void kv_write(float* k_pool, float* v_pool, const float* k, const float* v,
                                    const long long* slots, int kvd) {
    long long off = slots[blockIdx.x];
    const float* kt = k + (long long)blockIdx.x * kvd;
    const float* vt = v + (long long)blockIdx.x * kvd;
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) {
        k_pool[off + i] = kt[i];
        v_pool[off + i] = vt[i];
    }
}

// dst[dst_off[r] + i] = src[src_off[r] + i] for i < run_len: block copy (copy-on-write), gather
// of blocks into a contiguous staging buffer, scatter back (tiers, transport).
// grid (runs, chunks), block THREADS; each (run, chunk) block strides over its run.
extern "C" __global__ void copy_runs(const float* src, float* dst, const long long* src_off,
                                     const long long* dst_off, long long run_len) {
    const float* s = src + src_off[blockIdx.x];
    float* d = dst + dst_off[blockIdx.x];
    for (long long i = blockIdx.y * (long long)blockDim.x + threadIdx.x; i < run_len;
         i += (long long)gridDim.y * blockDim.x) {
        d[i] = s[i];
    }
}

// Paged causal attention, prefill and decode alike: for query token t (position positions[t])
// and head h, out[t, h, :] = softmax(q . K[0..=pos]^T * scale) . V[0..=pos], reading K/V of
// position p through block_tables[table_start[t] + p / block_size], KV head h / (n_heads /
// n_kv_heads). Online softmax over tiles of ATT_THREADS positions (one position per thread for
// the scores; one head dimension per thread, two when head_dim > ATT_THREADS, for the values).
// grid (tokens, n_heads), block ATT_THREADS; head_dim <= ATT_MAX_HEAD_DIM.
extern "C" __global__ void paged_attention(const float* q, const float* k_pool,
                                           const float* v_pool, const int* positions,
                                           const int* table_start, const int* block_tables,
                                           float* out, int n_heads, int n_kv_heads, int head_dim,
                                           int block_size, float scale) {
    __shared__ float qs[ATT_MAX_HEAD_DIM];
    __shared__ float ws[ATT_THREADS];
    __shared__ float sh[33];
    int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    int kvh = h / (n_heads / n_kv_heads);
    const float* qh = q + ((long long)t * n_heads + h) * head_dim;
    for (int i = tid; i < head_dim; i += blockDim.x) qs[i] = qh[i];
    __syncthreads();
    int pos = positions[t];
    const int* bt = block_tables + table_start[t];
    float m = NEG_INF, l = 0.0f, acc0 = 0.0f, acc1 = 0.0f;
    for (int p0 = 0; p0 <= pos; p0 += ATT_THREADS) {
        int p = p0 + tid;
        float s = NEG_INF;
        if (p <= pos) {
            long long off =
                (((long long)bt[p / block_size] * block_size + p % block_size) * n_kv_heads + kvh) *
                head_dim;
            float dot = 0.0f;
            for (int i = 0; i < head_dim; i++) dot += qs[i] * k_pool[off + i];
            s = dot * scale;
        }
        float m_new = fmaxf(m, block_max(s, sh));
        float corr = expf(m - m_new);
        float e = p <= pos ? expf(s - m_new) : 0.0f;
        ws[tid] = e;
        l = l * corr + block_sum(e, sh);
        acc0 *= corr;
        acc1 *= corr;
        int cnt = min(ATT_THREADS, pos - p0 + 1);
        for (int j = 0; j < cnt; j++) {
            int pp = p0 + j;
            long long off =
                (((long long)bt[pp / block_size] * block_size + pp % block_size) * n_kv_heads +
                 kvh) *
                head_dim;
            float wgt = ws[j];
            if (tid < head_dim) acc0 += wgt * v_pool[off + tid];
            if (tid + ATT_THREADS < head_dim) acc1 += wgt * v_pool[off + tid + ATT_THREADS];
        }
        m = m_new;
        __syncthreads();
    }
    float* o = out + ((long long)t * n_heads + h) * head_dim;
    float inv = 1.0f / l;
    if (tid < head_dim) o[tid] = acc0 * inv;
    if (tid + ATT_THREADS < head_dim) o[tid + ATT_THREADS] = acc1 * inv;
}

// ---------------------------------------------------------------------------------------------
// Sampling support: per row of logits, the argmax (lowest index on ties, NaN never wins, 0 when
// nothing beats -inf: the CPU's `argmax`), the max and log-sum-exp (f64 sum, as the CPU's
// `log_prob`). Greedy rows need only these; a stochastic row's logits go to the host, which
// draws with the sequence's own seeded generator, so draws are the CPU's by construction.
// grid (rows), block THREADS.
extern "C" __global__ void row_stats(const float* logits, int vocab, int* argmax, float* max_out,
                                     float* lse_out) {
    __shared__ float shv[THREADS];
    __shared__ int shi[THREADS];
    __shared__ double shd[THREADS];
    const float* x = logits + (long long)blockIdx.x * vocab;
    int tid = threadIdx.x;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = tid; i < vocab; i += blockDim.x) {
        float v = x[i];
        if (v > bv) {
            bv = v;
            bi = i;
        }
    }
    shv[tid] = bv;
    shi[tid] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) {
            float ov = shv[tid + s];
            int oi = shi[tid + s];
            if (ov > shv[tid] || (ov == shv[tid] && oi < shi[tid])) {
                shv[tid] = ov;
                shi[tid] = oi;
            }
        }
        __syncthreads();
    }
    float mx = shv[0];
    int best = shi[0];
    double sum = 0.0;
    for (int i = tid; i < vocab; i += blockDim.x) sum += exp((double)(x[i] - mx));
    shd[tid] = sum;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) shd[tid] += shd[tid + s];
        __syncthreads();
    }
    if (tid == 0) {
        argmax[blockIdx.x] = best == 0x7fffffff ? 0 : best;
        max_out[blockIdx.x] = mx;
        lse_out[blockIdx.x] = (float)log(shd[0]) + mx;
    }
}
