// The double-precision reference of every op, written from tandem.h's contracts with plain loops. It is
// deliberately naive: no tiling, no online softmax, no shared helpers with daemon/src/cpu_ops.cpp, so the
// two implementations can only agree by both being right.
#include "tandem/common/reference.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

#include "tandem/common/error.hpp"
#include "tandem/common/numeric.hpp"
#include "tandem/common/op_spec.hpp"

namespace tandem::reference {
namespace {

// splitmix64 (Steele, Lea, Flood 2014; the seeding generator of xoshiro): tiny, and good enough for test data.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Uniform in [0, bound); the modulo bias is irrelevant for test data.
  uint64_t below(uint64_t bound) { return next() % bound; }

 private:
  uint64_t state_;
};

SplitMix64 streamFor(uint64_t seed, uint32_t rank, std::size_t slotIndex) {
  SplitMix64 mixer(seed);
  const uint64_t a = mixer.next();
  SplitMix64 mixer2(a ^ (uint64_t{rank} << 32) ^ (uint64_t{slotIndex} + 1));
  return SplitMix64(mixer2.next());
}

// Element type of a slot, from the op table (kInvalid for the untyped bytes of allgather).
DType slotType(const OpDescriptor& d, int s) { return slotDtype(opSpec(d.kind).slots[static_cast<std::size_t>(s)], d); }

bool isOutput(OpKind kind, int s) { return opSpec(kind).slots[static_cast<std::size_t>(s)].output; }
std::string_view slotName(OpKind kind, int s) { return opSpec(kind).slots[static_cast<std::size_t>(s)].name; }

bool present(const OpDescriptor& d, int s) {
  const BufferRef& b = d.bufs[static_cast<std::size_t>(s)];
  return b.bufferId != 0 || b.bytes != 0;
}

std::vector<double> load(const std::byte* p, DType t, uint64_t count) {
  std::vector<double> v(count);
  for (uint64_t i = 0; i < count; ++i) v[i] = loadElement(p, t, i);
  return v;
}

std::vector<int64_t> loadInts(const std::byte* p, uint64_t count) {
  std::vector<int64_t> v(count);
  for (uint64_t i = 0; i < count; ++i) {
    int32_t x;
    std::memcpy(&x, p + i * 4, 4);
    v[i] = x;
  }
  return v;
}

// ---- ops --------------------------------------------------------------------------------------------

using In = std::span<const std::array<const std::byte*, kMaxOpBuffers>>;

// `only`: compute rank `only`'s outputs alone (the others stay empty), or every rank's when it is kAll.
constexpr int64_t kAll = -1;
bool wanted(int64_t only, uint32_t r) { return only == kAll || only == int64_t{r}; }

// A GEMM operand as [rows, k] (K-major), from its storage: [k, rows] when `transposed` (kFlagGemmLayout).
std::vector<double> loadKMajor(const std::byte* p, DType t, uint64_t rows, uint64_t k, bool transposed) {
  std::vector<double> v = load(p, t, rows * k);
  if (!transposed) return v;
  std::vector<double> out(rows * k);
  for (uint64_t i = 0; i < rows; ++i)
    for (uint64_t p2 = 0; p2 < k; ++p2) out[i * k + p2] = v[p2 * rows + i];
  return out;
}

// Rank r's GEMM operand dequantized: op(A) (rows of A) or op(B) (`isB`, rows = n), as [rows, k] in double. FP8 inputs
// are multiplied by their scale (descriptor.hpp's kFlagFp8BlockScale); other dtypes load as they are.
std::vector<double> operand(const OpDescriptor& d, const std::array<const std::byte*, kMaxOpBuffers>& in, bool isB,
                            uint64_t rows, uint64_t k) {
  const GemmOperands layout = gemmOperandsOf(d.flags);
  const int s = isB ? slot::kB : slot::kA;
  std::vector<double> v = loadKMajor(in[s], d.dtype, rows, k, isB ? !bKMajor(layout) : aTransposed(layout));
  if (!isFp8(d.dtype)) return v;
  const std::byte* scale = in[static_cast<std::size_t>(gemmScaleSlot(d.kind, isB))];
  const bool block = (d.flags & kFlagFp8BlockScale) != 0;
  const uint64_t kBlocks = (k + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  for (uint64_t i = 0; i < rows; ++i)
    for (uint64_t p = 0; p < k; ++p) {
      const uint64_t kb = p / kFp8ScaleBlock;
      const uint64_t at = !block ? 0 : isB ? (i / kFp8ScaleBlock) * kBlocks + kb : kb * rows + i;
      v[i * k + p] *= loadElement(scale, DType::kF32, at);
    }
  return v;
}

void agGemm(std::span<const OpDescriptor> descs, In in, Expected& out, int64_t only) {
  const uint32_t n = static_cast<uint32_t>(descs.size());
  const uint64_t M = descs[0].dims[dim::kM], N = descs[0].dims[dim::kN], K = descs[0].dims[dim::kK];
  std::vector<double> a(M * K), gathered(M * K);  // op(A) [M, K]; the shards as stored, in rank order
  for (uint32_t r = 0; r < n; ++r) {
    const uint64_t rows = rowsOf(M, r, n), first = rowOffset(M, r, n);
    const std::vector<double> shard = operand(descs[r], in[r], false, rows, K);
    std::copy(shard.begin(), shard.end(), a.begin() + static_cast<std::ptrdiff_t>(first * K));
    const std::vector<double> stored = load(in[r][slot::kA], descs[r].dtype, rows * K);
    std::copy(stored.begin(), stored.end(), gathered.begin() + static_cast<std::ptrdiff_t>(first * K));
  }
  for (uint32_t r = 0; r < n; ++r) {
    if (!wanted(only, r)) continue;
    const std::vector<double> b = operand(descs[r], in[r], true, N, K);
    std::vector<double> c(M * N);
    for (uint64_t i = 0; i < M; ++i)
      for (uint64_t j = 0; j < N; ++j) {
        double sum = 0;
        for (uint64_t p = 0; p < K; ++p) sum += a[i * K + p] * b[j * K + p];
        c[i * N + j] = sum;
      }
    out[r][slot::kC] = std::move(c);
    if (present(descs[r], slot::kAGathered)) out[r][slot::kAGathered] = gathered;
  }
}

void gemmReduce(std::span<const OpDescriptor> descs, In in, Expected& out, int64_t only) {
  const uint32_t n = static_cast<uint32_t>(descs.size());
  const uint64_t M = descs[0].dims[dim::kM], N = descs[0].dims[dim::kN];
  std::vector<double> c(M * N, 0.0);
  for (uint32_t r = 0; r < n; ++r) {
    const uint64_t K = descs[r].dims[dim::kK];
    const std::vector<double> a = operand(descs[r], in[r], false, M, K);
    const std::vector<double> b = operand(descs[r], in[r], true, N, K);
    for (uint64_t i = 0; i < M; ++i)
      for (uint64_t j = 0; j < N; ++j)
        for (uint64_t p = 0; p < K; ++p) c[i * N + j] += a[i * K + p] * b[j * K + p];
  }
  for (uint32_t r = 0; r < n; ++r) {
    if (!wanted(only, r)) continue;
    if (descs[0].kind == OpKind::kGemmAr) {
      out[r][slot::kC] = c;
    } else {
      const auto first = static_cast<std::ptrdiff_t>(rowOffset(M, r, n) * N);
      const auto count = static_cast<std::ptrdiff_t>(rowsOf(M, r, n) * N);
      out[r][slot::kC].assign(c.begin() + first, c.begin() + first + count);
    }
  }
}

// One routed (token, slot) pair.
struct Route {
  uint32_t srcRank;
  uint64_t token;
  uint64_t slotIndex;
};

// routes[e] lists the pairs sent to global expert e, in (source rank, token, slot) order.
std::vector<std::vector<Route>> route(std::span<const OpDescriptor> descs, In in) {
  const std::string_view kind = opKindName(descs[0].kind);
  const uint64_t E = descs[0].dims[dim::kExperts], topk = descs[0].dims[dim::kTopk];
  std::vector<std::vector<Route>> routes(E);
  for (uint32_t s = 0; s < descs.size(); ++s) {
    const uint64_t tokens = descs[s].dims[dim::kTokens];
    const std::vector<int64_t> ids = loadInts(in[s][slot::kTopkIds], tokens * topk);
    for (uint64_t t = 0; t < tokens; ++t)
      for (uint64_t j = 0; j < topk; ++j) {
        const int64_t e = ids[t * topk + j];
        if (e < 0 || static_cast<uint64_t>(e) >= E) {
          fail(ErrorCode::kInvalidArgument, "reference {}: rank {} topk_ids[{}][{}] = {} is out of range [0, {})", kind,
               s, t, j, e, E);
        }
        for (uint64_t j2 = 0; j2 < j; ++j2)
          if (ids[t * topk + j2] == e)
            fail(ErrorCode::kInvalidArgument, "reference {}: rank {} token {} names expert {} twice", kind, s, t, e);
        routes[static_cast<uint64_t>(e)].push_back({s, t, j});
      }
  }
  return routes;
}

// The MoE ops' FP8 activations (tandem.h): each 1 x 128 block of a row quantised in fp32 and dequantised.
void quantizeRow(double* row, uint64_t cols) {
  std::vector<float> block(kFp8ScaleBlock);
  for (uint64_t c = 0; c < cols; c += kFp8ScaleBlock) {
    const uint64_t count = std::min<uint64_t>(kFp8ScaleBlock, cols - c);
    for (uint64_t i = 0; i < count; ++i) block[i] = static_cast<float>(row[c + i]);
    quantizeE4m3Block(block.data(), count, block.data());
    for (uint64_t i = 0; i < count; ++i) row[c + i] = block[i];
  }
}

// Local expert le's weight [rows, cols] from rank d's weights w (w_dtype), FP8 ones times their 128 x 128 block scale
// (scale, [E/n, ceil(rows/128), ceil(cols/128)]).
std::vector<double> expertWeight(const OpDescriptor& d, const std::byte* w, const std::byte* scale, uint64_t le,
                                 uint64_t rows, uint64_t cols) {
  const DType t = moeWeightDtype(d.dtype, d.flags);
  std::vector<double> v = load(w + le * rows * cols * dtypeSize(t), t, rows * cols);
  if (!isFp8(t)) return v;
  const uint64_t rb = (rows + kFp8ScaleBlock - 1) / kFp8ScaleBlock, cb = (cols + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  for (uint64_t i = 0; i < rows; ++i)
    for (uint64_t p = 0; p < cols; ++p)
      v[i * cols + p] *= loadElement(scale, DType::kF32, (le * rb + i / kFp8ScaleBlock) * cb + p / kFp8ScaleBlock);
  return v;
}

void moeGemm(std::span<const OpDescriptor> descs, In in, Expected& out, int64_t only) {
  const uint32_t n = static_cast<uint32_t>(descs.size());
  const uint64_t H = descs[0].dims[dim::kHidden], NO = descs[0].dims[dim::kNOut], E = descs[0].dims[dim::kExperts];
  const uint64_t L = E / n;
  const bool fp8 = isFp8(moeWeightDtype(descs[0].dtype, descs[0].flags));
  const std::vector<std::vector<Route>> routes = route(descs, in);
  std::vector<std::vector<double>> x(n);
  for (uint32_t s = 0; s < n; ++s) {
    const uint64_t tokens = descs[s].dims[dim::kTokens];
    x[s] = load(in[s][slot::kX], descs[s].dtype, tokens * H);
    if (fp8) {  // tandem.h: quantised once per token, as the FFN's x
      for (uint64_t t = 0; t < tokens; ++t) quantizeRow(&x[s][t * H], H);
    }
  }
  for (uint32_t d = 0; d < n; ++d) {
    if (!wanted(only, d)) continue;
    std::vector<double> y, info, counts;
    for (uint64_t le = 0; le < L; ++le) {
      const uint64_t e = d * L + le;
      const std::vector<double> w = expertWeight(descs[d], in[d][slot::kW], in[d][slot::kMoeWScale], le, NO, H);
      counts.push_back(static_cast<double>(routes[e].size()));
      for (const Route& rt : routes[e]) {
        for (uint64_t o = 0; o < NO; ++o) {
          double sum = 0;
          for (uint64_t h = 0; h < H; ++h) sum += x[rt.srcRank][rt.token * H + h] * w[o * H + h];
          y.push_back(sum);
        }
        info.insert(info.end(), {double(rt.srcRank), double(rt.token), double(rt.slotIndex), double(e)});
      }
    }
    const uint64_t rows = info.size() / 4;
    if (rows > descs[d].dims[dim::kCapacity]) {
      fail(ErrorCode::kInvalidArgument, "reference moe-dispatch-gemm: rank {} receives {} rows but capacity is {}", d,
           rows, descs[d].dims[dim::kCapacity]);
    }
    out[d][slot::kMoeOut] = std::move(y);
    out[d][slot::kRowInfo] = std::move(info);
    out[d][slot::kExpertCounts] = std::move(counts);
  }
}

// Rank d's saved rows (tandem.h): as many as its experts receive. Returns the row count of every rank.
std::vector<uint64_t> savedRowCounts(std::span<const OpDescriptor> descs,
                                     const std::vector<std::vector<Route>>& routes) {
  const auto n = static_cast<uint32_t>(descs.size());
  const uint64_t L = descs[0].dims[dim::kExperts] / n;
  std::vector<uint64_t> rows(n, 0);
  for (uint32_t d = 0; d < n; ++d) {
    for (uint64_t le = 0; le < L; ++le) rows[d] += routes[d * L + le].size();
    const uint64_t capacity = descs[d].dims[dim::kSavedRows];
    if (capacity != 0 && rows[d] > capacity) {
      fail(ErrorCode::kInvalidArgument, "reference {}: rank {} receives {} rows but saved_rows is {}",
           opKindName(descs[0].kind), d, rows[d], capacity);
    }
  }
  return rows;
}

void moeFfn(std::span<const OpDescriptor> descs, In in, Expected& out, int64_t only) {
  const uint32_t n = static_cast<uint32_t>(descs.size());
  const DType dtype = descs[0].dtype;
  const bool fp8 = isFp8(moeWeightDtype(dtype, descs[0].flags));
  const uint64_t H = descs[0].dims[dim::kHidden], F = descs[0].dims[dim::kFfn], E = descs[0].dims[dim::kExperts];
  const uint64_t topk = descs[0].dims[dim::kTopk], L = E / n;
  const std::vector<std::vector<Route>> routes = route(descs, in);
  savedRowCounts(descs, routes);
  std::vector<std::vector<double>> x(n), weights(n), result(n), saved(n);
  for (uint32_t s = 0; s < n; ++s) {
    const uint64_t tokens = descs[s].dims[dim::kTokens];
    x[s] = load(in[s][slot::kX], dtype, tokens * H);
    if (fp8) {
      for (uint64_t t = 0; t < tokens; ++t) quantizeRow(&x[s][t * H], H);
    }
    weights[s] = load(in[s][slot::kTopkWeights], DType::kF32, tokens * topk);
    result[s].assign(tokens * H, 0.0);
  }
  for (uint64_t e = 0; e < E; ++e) {
    const uint32_t d = static_cast<uint32_t>(e / L);
    const uint64_t le = e % L;
    // A rank that saves gate|up keeps it rounded to dtype, and its h comes from the rounded values (tandem.h).
    const bool saves = descs[d].dims[dim::kSavedRows] != 0;
    const std::vector<double> w1 =
        expertWeight(descs[d], in[d][slot::kW1], in[d][slot::kFfnW1Scale], le, 2 * F, H);
    const std::vector<double> w2 = expertWeight(descs[d], in[d][slot::kW2], in[d][slot::kFfnW2Scale], le, H, F);
    for (const Route& rt : routes[e]) {
      const bool wantSaved = saves && wanted(only, d);
      if (!wanted(only, rt.srcRank) && !wantSaved) continue;
      const double* xt = &x[rt.srcRank][rt.token * H];
      std::vector<double> h(F), gate(F), up(F);
      for (uint64_t f = 0; f < F; ++f) {
        for (uint64_t i = 0; i < H; ++i) {
          gate[f] += xt[i] * w1[f * H + i];
          up[f] += xt[i] * w1[(F + f) * H + i];
        }
        if (saves) {
          gate[f] = roundTo(dtype, static_cast<float>(gate[f]));
          up[f] = roundTo(dtype, static_cast<float>(up[f]));
        }
        const double silu = gate[f] / (1.0 + std::exp(-gate[f]));
        // tandem.h: h is rounded to dtype; with FP8 weights computed in fp32 and quantised per 1 x 128 block
        h[f] = fp8 ? static_cast<float>(silu * up[f]) : roundTo(dtype, static_cast<float>(silu * up[f]));
      }
      if (fp8) quantizeRow(h.data(), F);
      if (wantSaved) {
        saved[d].insert(saved[d].end(), gate.begin(), gate.end());
        saved[d].insert(saved[d].end(), up.begin(), up.end());
      }
      if (!wanted(only, rt.srcRank)) continue;
      const double weight = weights[rt.srcRank][rt.token * topk + rt.slotIndex];
      for (uint64_t o = 0; o < H; ++o) {
        double y = 0;
        for (uint64_t f = 0; f < F; ++f) y += h[f] * w2[o * F + f];
        result[rt.srcRank][rt.token * H + o] += weight * y;
      }
    }
  }
  for (uint32_t s = 0; s < n; ++s) {
    if (!wanted(only, s)) continue;
    out[s][slot::kFfnOut] = std::move(result[s]);
    out[s][slot::kFfnSaved] = std::move(saved[s]);
  }
}

// The backward of moeFfn (tandem.h), straight from the chain rule: for each routed (token, slot), y = h w2^T with
// h = silu(a) * b rounded as the forward rounds it (a and b from the owner's saved rows where it passed them);
// dtopk_weight = dout.y, dh = weight * dout w2, da = dh * b * silu'(a), db = dh * silu(a),
// dx += da w1_gate + db w1_up, dw1 += [da; db] x^T, dw2 += weight dout h^T.
void moeFfnBackward(std::span<const OpDescriptor> descs, In in, Expected& out, int64_t only) {
  const uint32_t n = static_cast<uint32_t>(descs.size());
  const DType dtype = descs[0].dtype;
  const uint64_t H = descs[0].dims[dim::kHidden], F = descs[0].dims[dim::kFfn], E = descs[0].dims[dim::kExperts];
  const uint64_t topk = descs[0].dims[dim::kTopk], L = E / n;
  const std::vector<std::vector<Route>> routes = route(descs, in);
  savedRowCounts(descs, routes);
  std::vector<std::vector<double>> x(n), weights(n), dout(n), dx(n), dweights(n), dw1(n), dw2(n);
  std::vector<uint64_t> savedRow(n, 0);  // the next saved row of each rank: rows in expert, then route order
  for (uint32_t s = 0; s < n; ++s) {
    const uint64_t tokens = descs[s].dims[dim::kTokens];
    x[s] = load(in[s][slot::kX], dtype, tokens * H);
    weights[s] = load(in[s][slot::kTopkWeights], DType::kF32, tokens * topk);
    dout[s] = load(in[s][slot::kMoeDout], dtype, tokens * H);
    dx[s].assign(tokens * H, 0.0);
    dweights[s].assign(tokens * topk, 0.0);
    dw1[s].assign(L * 2 * F * H, 0.0);
    dw2[s].assign(L * H * F, 0.0);
  }
  std::vector<double> a(F), b(F), h(F);
  for (uint64_t e = 0; e < E; ++e) {
    const uint32_t d = static_cast<uint32_t>(e / L);
    const uint64_t le = e % L;
    const std::vector<double> w1 = load(in[d][slot::kW1] + le * 2 * F * H * dtypeSize(dtype), dtype, 2 * F * H);
    const std::vector<double> w2 = load(in[d][slot::kW2] + le * H * F * dtypeSize(dtype), dtype, H * F);
    double* gw1 = &dw1[d][le * 2 * F * H];
    double* gw2 = &dw2[d][le * H * F];
    for (const Route& rt : routes[e]) {
      const double* xt = &x[rt.srcRank][rt.token * H];
      const double* gt = &dout[rt.srcRank][rt.token * H];
      const double weight = weights[rt.srcRank][rt.token * topk + rt.slotIndex];
      if (descs[d].dims[dim::kSavedRows] != 0) {  // a and b as the forward saved them
        const std::vector<double> ab =
            load(in[d][slot::kMoeBwdSaved] + savedRow[d]++ * 2 * F * dtypeSize(dtype), dtype, 2 * F);
        std::copy_n(ab.begin(), F, a.begin());
        std::copy_n(ab.begin() + static_cast<std::ptrdiff_t>(F), F, b.begin());
      }
      for (uint64_t f = 0; f < F; ++f) {
        if (descs[d].dims[dim::kSavedRows] == 0) {
          a[f] = b[f] = 0;
          for (uint64_t i = 0; i < H; ++i) {
            a[f] += xt[i] * w1[f * H + i];
            b[f] += xt[i] * w1[(F + f) * H + i];
          }
        }
        h[f] = roundTo(dtype, static_cast<float>(a[f] / (1.0 + std::exp(-a[f])) * b[f]));
      }
      double dweight = 0;
      for (uint64_t o = 0; o < H; ++o) {
        double y = 0;
        for (uint64_t f = 0; f < F; ++f) y += h[f] * w2[o * F + f];
        dweight += gt[o] * y;
        for (uint64_t f = 0; f < F; ++f) gw2[o * F + f] += weight * gt[o] * h[f];
      }
      dweights[rt.srcRank][rt.token * topk + rt.slotIndex] = dweight;
      double* dxt = &dx[rt.srcRank][rt.token * H];
      for (uint64_t f = 0; f < F; ++f) {
        double dh = 0;
        for (uint64_t o = 0; o < H; ++o) dh += weight * gt[o] * w2[o * F + f];
        const double sig = 1.0 / (1.0 + std::exp(-a[f]));
        const double da = dh * b[f] * sig * (1.0 + a[f] * (1.0 - sig)), db = dh * a[f] * sig;
        for (uint64_t i = 0; i < H; ++i) {
          dxt[i] += da * w1[f * H + i] + db * w1[(F + f) * H + i];
          gw1[f * H + i] += da * xt[i];
          gw1[(F + f) * H + i] += db * xt[i];
        }
      }
    }
  }
  for (uint32_t s = 0; s < n; ++s) {
    if (!wanted(only, s)) continue;
    out[s][slot::kMoeDx] = std::move(dx[s]);
    out[s][slot::kMoeDtopkWeights] = std::move(dweights[s]);
    out[s][slot::kMoeDw1] = std::move(dw1[s]);
    out[s][slot::kMoeDw2] = std::move(dw2[s]);
  }
}

// Global position of every rank's rows; S receives the total. Contiguous: rank after rank. Zigzag: 2n chunks in order;
// chunk c < n is the first ceil(seq_c / 2) rows of rank c, chunk c >= n the remaining rows of rank 2n - 1 - c.
std::vector<std::vector<uint64_t>> attentionPositions(std::span<const OpDescriptor> descs, bool zigzag, uint64_t& S) {
  const uint32_t n = static_cast<uint32_t>(descs.size());
  std::vector<std::vector<uint64_t>> pos(n);
  S = 0;
  if (!zigzag) {
    for (uint32_t r = 0; r < n; ++r)
      for (uint64_t i = 0; i < descs[r].dims[dim::kSeq]; ++i) pos[r].push_back(S++);
    return pos;
  }
  for (uint32_t c = 0; c < 2 * n; ++c) {
    const uint32_t r = c < n ? c : 2 * n - 1 - c;
    const uint64_t seq = descs[r].dims[dim::kSeq], first = seq - seq / 2;
    const uint64_t lo = c < n ? 0 : first, hi = c < n ? first : seq;
    pos[r].resize(seq);
    for (uint64_t i = lo; i < hi; ++i) pos[r][i] = S++;
  }
  return pos;
}

void ringAttention(std::span<const OpDescriptor> descs, In in, Expected& out, int64_t only) {
  const uint32_t n = static_cast<uint32_t>(descs.size());
  const DType dtype = descs[0].dtype;
  const uint64_t heads = descs[0].dims[dim::kHeads], D = descs[0].dims[dim::kHeadDim];
  const uint64_t kvHeads = descs[0].dims[dim::kKvHeads];
  const bool causal = (descs[0].flags & kFlagCausal) != 0;
  const bool zigzag = (descs[0].flags & kFlagZigzag) != 0;
  const double scale = descs[0].scale != 0.0f ? double(descs[0].scale) : 1.0 / std::sqrt(double(D));
  uint64_t S = 0;
  const std::vector<std::vector<uint64_t>> pos = attentionPositions(descs, zigzag, S);
  // k and v widened to one KV head per query head: query head h reads KV head h / (heads / kvHeads).
  std::vector<double> q(S * heads * D), k(S * heads * D), v(S * heads * D);
  for (uint32_t r = 0; r < n; ++r) {
    const uint64_t seq = descs[r].dims[dim::kSeq], row = heads * D;
    for (auto [dst, s] : {std::pair{&q, slot::kQ}, std::pair{&k, slot::kKey}, std::pair{&v, slot::kValue}}) {
      const uint64_t stored = s == slot::kQ ? heads : kvHeads;
      std::vector<double> part = load(in[r][static_cast<std::size_t>(s)], dtype, seq * stored * D);
      if (stored != heads) {
        std::vector<double> wide(seq * row);
        for (uint64_t i = 0; i < seq; ++i)
          for (uint64_t h = 0; h < heads; ++h)
            for (uint64_t c = 0; c < D; ++c) wide[(i * heads + h) * D + c] = part[(i * kvHeads + h / (heads / kvHeads)) * D + c];
        part = std::move(wide);
      }
      for (uint64_t i = 0; i < seq; ++i) {
        std::copy_n(part.begin() + static_cast<std::ptrdiff_t>(i * row), row,
                    dst->begin() + static_cast<std::ptrdiff_t>(pos[r][i] * row));
      }
    }
  }
  std::vector<double> o(S * heads * D), lse(S * heads);
  std::vector<double> p(S);
  for (uint64_t i = 0; i < S; ++i)
    for (uint64_t h = 0; h < heads; ++h) {
      const uint64_t keys = causal ? i + 1 : S;
      double mx = -std::numeric_limits<double>::infinity();
      for (uint64_t j = 0; j < keys; ++j) {
        double dot = 0;
        for (uint64_t c = 0; c < D; ++c) dot += q[(i * heads + h) * D + c] * k[(j * heads + h) * D + c];
        p[j] = dot * scale;
        mx = std::max(mx, p[j]);
      }
      double sum = 0;
      for (uint64_t j = 0; j < keys; ++j) sum += (p[j] = std::exp(p[j] - mx));
      for (uint64_t c = 0; c < D; ++c) {
        double acc = 0;
        for (uint64_t j = 0; j < keys; ++j) acc += p[j] * v[(j * heads + h) * D + c];
        o[(i * heads + h) * D + c] = acc / sum;
      }
      lse[i * heads + h] = mx + std::log(sum);  // every row sees at least itself, so sum >= 1
    }
  for (uint32_t r = 0; r < n; ++r) {
    if (!wanted(only, r)) continue;
    const uint64_t seq = descs[r].dims[dim::kSeq], row = heads * D;
    std::vector<double>& dst = out[r][slot::kAttnOut];
    dst.resize(seq * row);
    for (uint64_t i = 0; i < seq; ++i) {
      std::copy_n(o.begin() + static_cast<std::ptrdiff_t>(pos[r][i] * row), row,
                  dst.begin() + static_cast<std::ptrdiff_t>(i * row));
    }
    if (present(descs[r], slot::kAttnLse) && seq > 0) {
      std::vector<double>& l = out[r][slot::kAttnLse];
      l.resize(heads * seq);
      for (uint64_t h = 0; h < heads; ++h)
        for (uint64_t i = 0; i < seq; ++i) l[h * seq + i] = lse[pos[r][i] * heads + h];
    }
  }
}

// FlashAttention's backward from the forward's out and lse (tandem.h): P = exp(scale q.k - lse), D = dout.out,
// dV = P^T dout, dS = P (dout V^T - D), dQ = scale dS K, dK = scale dS^T Q; KV head g sums its query heads.
void ringAttentionBackward(std::span<const OpDescriptor> descs, In in, Expected& out, int64_t only) {
  const uint32_t n = static_cast<uint32_t>(descs.size());
  const DType dtype = descs[0].dtype;
  const uint64_t heads = descs[0].dims[dim::kHeads], D = descs[0].dims[dim::kHeadDim];
  const uint64_t kvHeads = descs[0].dims[dim::kKvHeads], group = heads / kvHeads;
  const bool causal = (descs[0].flags & kFlagCausal) != 0;
  const double scale = descs[0].scale != 0.0f ? double(descs[0].scale) : 1.0 / std::sqrt(double(D));
  uint64_t S = 0;
  const std::vector<std::vector<uint64_t>> pos = attentionPositions(descs, (descs[0].flags & kFlagZigzag) != 0, S);
  // Every rank's rows at their global positions.
  const auto gather = [&](int s, uint64_t h) {
    std::vector<double> all(S * h * D);
    for (uint32_t r = 0; r < n; ++r) {
      const uint64_t seq = descs[r].dims[dim::kSeq];
      const std::vector<double> part = load(in[r][static_cast<std::size_t>(s)], dtype, seq * h * D);
      for (uint64_t i = 0; i < seq; ++i)
        std::copy_n(part.begin() + static_cast<std::ptrdiff_t>(i * h * D), h * D,
                    all.begin() + static_cast<std::ptrdiff_t>(pos[r][i] * h * D));
    }
    return all;
  };
  const std::vector<double> q = gather(slot::kQ, heads), o = gather(slot::kAttnOut, heads),
                            dout = gather(slot::kDout, heads), k = gather(slot::kKey, kvHeads),
                            v = gather(slot::kValue, kvHeads);
  std::vector<double> lse(S * heads);
  for (uint32_t r = 0; r < n; ++r) {
    const uint64_t seq = descs[r].dims[dim::kSeq];
    const std::vector<double> part = load(in[r][slot::kBwdLse], DType::kF32, heads * seq);
    for (uint64_t h = 0; h < heads; ++h)
      for (uint64_t i = 0; i < seq; ++i) lse[pos[r][i] * heads + h] = part[h * seq + i];
  }
  std::vector<double> dq(S * heads * D, 0.0), dk(S * kvHeads * D, 0.0), dv(S * kvHeads * D, 0.0);
  for (uint64_t i = 0; i < S; ++i)
    for (uint64_t h = 0; h < heads; ++h) {
      const double* qi = &q[(i * heads + h) * D];
      const double* oi = &o[(i * heads + h) * D];
      const double* gi = &dout[(i * heads + h) * D];
      double delta = 0;
      for (uint64_t c = 0; c < D; ++c) delta += gi[c] * oi[c];
      const uint64_t g = h / group;
      for (uint64_t j = 0; j < (causal ? i + 1 : S); ++j) {
        const double* kj = &k[(j * kvHeads + g) * D];
        const double* vj = &v[(j * kvHeads + g) * D];
        double s = 0, dp = 0;
        for (uint64_t c = 0; c < D; ++c) {
          s += qi[c] * kj[c];
          dp += gi[c] * vj[c];
        }
        const double p = std::exp(s * scale - lse[i * heads + h]);
        const double ds = p * (dp - delta);
        for (uint64_t c = 0; c < D; ++c) {
          dv[(j * kvHeads + g) * D + c] += p * gi[c];
          dq[(i * heads + h) * D + c] += scale * ds * kj[c];
          dk[(j * kvHeads + g) * D + c] += scale * ds * qi[c];
        }
      }
    }
  for (uint32_t r = 0; r < n; ++r) {
    if (!wanted(only, r)) continue;
    const uint64_t seq = descs[r].dims[dim::kSeq];
    for (auto [s, src, h] : {std::tuple{slot::kDq, &dq, heads}, std::tuple{slot::kDk, &dk, kvHeads},
                             std::tuple{slot::kDv, &dv, kvHeads}}) {
      std::vector<double>& dst = out[r][static_cast<std::size_t>(s)];
      dst.resize(seq * h * D);
      for (uint64_t i = 0; i < seq; ++i)
        std::copy_n(src->begin() + static_cast<std::ptrdiff_t>(pos[r][i] * h * D), h * D,
                    dst.begin() + static_cast<std::ptrdiff_t>(i * h * D));
    }
  }
}

void allGather(std::span<const OpDescriptor> descs, In in, Expected& out, int64_t only) {
  const uint64_t bytes = descs[0].dims[dim::kBytes];
  std::vector<double> all;
  for (uint32_t r = 0; r < descs.size(); ++r)
    for (uint64_t i = 0; i < bytes; ++i) all.push_back(static_cast<double>(std::to_integer<uint8_t>(in[r][slot::kSend][i])));
  for (uint32_t r = 0; r < descs.size(); ++r) {
    if (wanted(only, r)) out[r][slot::kRecv] = all;
  }
}

void barrier(std::span<const OpDescriptor>, In, Expected&, int64_t) {}  // no outputs

using Implementation = void (*)(std::span<const OpDescriptor>, In, Expected&, int64_t only);
// One reference per op in the table (a test checks that none is missing).
Implementation implementation(OpKind kind) {
  switch (kind) {
    case OpKind::kAgGemm: return agGemm;
    case OpKind::kGemmRs:
    case OpKind::kGemmAr: return gemmReduce;
    case OpKind::kMoeDispatchGemm: return moeGemm;
    case OpKind::kMoeDispatchFfnCombine: return moeFfn;
    case OpKind::kRingAttention: return ringAttention;
    case OpKind::kRingAttentionBackward: return ringAttentionBackward;
    case OpKind::kMoeFfnBackward: return moeFfnBackward;
    case OpKind::kAllGather: return allGather;
    case OpKind::kNop: return barrier;
    case OpKind::kInvalid: break;
  }
  return nullptr;
}

}  // namespace

bool hasReference(OpKind kind) { return implementation(kind) != nullptr; }

uint64_t OpShape::value(std::string_view option) const {
  if (option == "m") return m;
  if (option == "n") return n;
  if (option == "k") return k;
  if (option == "experts") return experts;
  if (option == "topk") return topk;
  if (option == "saved-rows") return savedRows;
  if (option == "seq") return seq;
  if (option == "heads") return heads;
  if (option == "head-dim") return headDim;
  if (option == "kv-heads") return kvHeads == 0 ? heads : kvHeads;
  if (option == "bytes") return bytes;
  fail(ErrorCode::kInternal, "OpShape has no size named --{}; add it to OpShape (reference.hpp)", option);
}

OpDescriptor makeDescriptor(const OpShape& shape, uint32_t rank, uint32_t nranks) {
  const OpSpec& op = opSpec(shape.kind);
  OpDescriptor d{};
  d.version = kDescriptorVersion;
  d.kind = shape.kind;
  d.dtype = shape.dtype;
  d.rank = rank;
  d.nranks = nranks;
  if ((op.flags & kFlagCausal) != 0 && shape.causal) d.flags |= kFlagCausal;
  if ((op.flags & kFlagZigzag) != 0 && shape.zigzag) d.flags |= kFlagZigzag;
  if ((op.flags & kFlagGemmLayout) != 0) d.flags |= gemmLayoutFlags(shape.layout);
  if (op.fp8 && isFp8(shape.dtype)) {  // FP8 inputs need an output dtype: bf16 unless the shape says
    const DType out = shape.outDtype == DType::kInvalid ? DType::kBF16 : shape.outDtype;
    d.flags |= static_cast<uint16_t>(static_cast<unsigned>(out) << kGemmOutDtypeShift);
    if (shape.blockScale) d.flags |= kFlagFp8BlockScale;
  }
  if (op.fp8Weights && shape.weightDtype != DType::kInvalid && shape.weightDtype != shape.dtype) {
    d.flags |= static_cast<uint16_t>(static_cast<unsigned>(shape.weightDtype) << kMoeWeightDtypeShift);
  }
  auto dimNamed = [&](std::string_view name) {
    for (int i = 0; i < op.dimCount; ++i) {
      if (op.dims[static_cast<std::size_t>(i)].name == name) return d.dims[static_cast<std::size_t>(i)];
    }
    fail(ErrorCode::kInternal, "{} has no dim {}", op.name, name);
  };
  for (int i = 0; i < op.dimCount; ++i) {
    const DimSpec& ds = op.dims[static_cast<std::size_t>(i)];
    uint64_t& v = d.dims[static_cast<std::size_t>(i)];
    switch (ds.split) {
      case DimSplit::kGlobal:
      case DimSplit::kPerRank: v = shape.value(ds.cli); break;
      case DimSplit::kSplit: v = rowsOf(shape.value(ds.cli), rank, nranks); break;
      case DimSplit::kCapacity: v = std::max<uint64_t>(1, uint64_t{nranks} * dimNamed("tokens") * dimNamed("topk")); break;
    }
  }
  for (int s = 0; s < op.slotCount; ++s) d.bufs[static_cast<std::size_t>(s)].bytes = slotBytes(op, s, d);
  return d;
}

void fillInputs(const OpDescriptor& desc, std::span<std::byte* const> slots, uint64_t seed) {
  for (std::size_t s = 0; s < slots.size() && s < kMaxOpBuffers; ++s) {
    std::byte* p = slots[s];
    const uint64_t bytes = desc.bufs[s].bytes;
    if (p == nullptr || bytes == 0) continue;
    const int si = static_cast<int>(s);
    if (isOutput(desc.kind, si)) {
      std::memset(p, 0xFF, bytes);  // NaN in fp32, fp16 and bf16; -1 in int32
      continue;
    }
    SplitMix64 rng = streamFor(seed, desc.rank, s);
    const DType t = slotType(desc, si);
    if (t == DType::kInvalid) {
      for (uint64_t i = 0; i < bytes; ++i) p[i] = static_cast<std::byte>(rng.next() >> 56);
    } else if (slotName(desc.kind, si) == "topk_ids") {
      const uint64_t tokens = desc.dims[dim::kTokens], topk = desc.dims[dim::kTopk], E = desc.dims[dim::kExperts];
      std::vector<int32_t> chosen;
      for (uint64_t tk = 0; tk < tokens; ++tk) {
        chosen.clear();
        while (chosen.size() < topk) {
          const auto e = static_cast<int32_t>(rng.below(E));
          if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
        }
        std::memcpy(p + tk * topk * 4, chosen.data(), topk * 4);
      }
    } else if (slotName(desc.kind, si) == "topk_weights") {
      const uint64_t tokens = desc.dims[dim::kTokens], topk = desc.dims[dim::kTopk];
      std::vector<double> w(topk);
      for (uint64_t tk = 0; tk < tokens; ++tk) {
        double sum = 0;
        for (double& x : w) sum += (x = 0.1 + 0.9 * rng.uniform());
        for (uint64_t j = 0; j < topk; ++j) storeElement(p, DType::kF32, tk * topk + j, static_cast<float>(w[j] / sum));
      }
    } else if (opSpec(desc.kind).slots[s].fp8Scale) {  // positive scales around 1, so the product stays O(1)
      for (uint64_t i = 0; i < bytes / 4; ++i) storeElement(p, DType::kF32, i, static_cast<float>(0.5 + rng.uniform()));
    } else {
      const uint64_t count = bytes / dtypeSize(t);
      for (uint64_t i = 0; i < count; ++i) storeElement(p, t, i, static_cast<float>(2.0 * rng.uniform() - 1.0));
    }
  }
}

namespace {

Expected run(std::span<const OpDescriptor> descs, std::span<const std::array<const std::byte*, kMaxOpBuffers>> inputs,
             int64_t only) {
  Expected out(descs.size());
  if (descs.empty()) return out;
  if (inputs.size() != descs.size()) {
    fail(ErrorCode::kInvalidArgument, "reference: {} descriptors but {} input sets; pass one per rank", descs.size(),
         inputs.size());
  }
  const auto fn = implementation(descs[0].kind);
  if (fn == nullptr) fail(ErrorCode::kUnsupported, "reference: no implementation of {}", opKindName(descs[0].kind));
  fn(descs, inputs, out, only);
  return out;
}

}  // namespace

Expected compute(std::span<const OpDescriptor> descs,
                 std::span<const std::array<const std::byte*, kMaxOpBuffers>> inputs) {
  return run(descs, inputs, kAll);
}

std::array<std::vector<double>, kMaxOpBuffers> computeRank(
    std::span<const OpDescriptor> descs, std::span<const std::array<const std::byte*, kMaxOpBuffers>> inputs,
    uint32_t rank) {
  if (rank >= descs.size()) {
    fail(ErrorCode::kInvalidArgument, "reference: rank {} but only {} descriptors; pass one per rank", rank,
         descs.size());
  }
  return std::move(run(descs, inputs, rank)[rank]);
}

constexpr double kFp8MoeTolerance = 3e-2;

double tolerance(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return 1e-2;
    case DType::kF16: return 2e-3;
    case DType::kF32: return 1e-5;
    default: return 0.0;
  }
}

Comparison compareRank(const OpDescriptor& desc, std::span<const std::byte* const> slots,
                       const std::array<std::vector<double>, kMaxOpBuffers>& expected) {
  Comparison result;
  // FP8 inputs are compared with their dequantized values, so the output's rounding sets the tolerance.
  result.tolerance = tolerance(isFp8(desc.dtype) ? gemmOutDtype(desc.dtype, desc.flags) : desc.dtype);
  // The MoE FFN's FP8 weights: the reference quantises h from fp64 sums, a GPU from its fp8 tensor cores' sums (about
  // 1e-4 to 1e-3 apart), and an h value near an e4m3 rounding boundary (steps of 1/16 to 1/8 of the value) then rounds
  // the other way: out moves by about 1e-2 at 1e-3 apart (simulated), so the bound is bf16's times 3. Dispatch+GEMM
  // quantises x alone, alike everywhere (fp32, tandem.h), so its out keeps bf16's bound.
  if (desc.kind == OpKind::kMoeDispatchFfnCombine && isFp8(moeWeightDtype(desc.dtype, desc.flags))) {
    result.tolerance = kFp8MoeTolerance;
  }
  std::string problems;
  auto problem = [&problems](const std::string& text) {
    if (problems.empty()) problems = text;
  };
  for (std::size_t s = 0; s < kMaxOpBuffers; ++s) {
    const std::vector<double>& want = expected[s];
    if (want.empty()) continue;
    const int si = static_cast<int>(s);
    const std::string slotName = fmt::format("rank {} slot {}", desc.rank, s);
    if (s >= slots.size() || slots[s] == nullptr) {
      problem(fmt::format("{}: no memory to compare", slotName));
      continue;
    }
    const DType t = slotType(desc, si);
    const std::size_t es = t == DType::kInvalid ? 1 : dtypeSize(t);
    if (want.size() * es > desc.bufs[s].bytes) {
      problem(fmt::format("{}: expected {} elements but the slot holds {} bytes", slotName, want.size(),
                          desc.bufs[s].bytes));
      continue;
    }
    if (t == DType::kInvalid || t == DType::kI32) {  // exact
      for (std::size_t i = 0; i < want.size(); ++i) {
        const double got = t == DType::kInvalid ? static_cast<double>(std::to_integer<uint8_t>(slots[s][i]))
                                                : static_cast<double>(loadInts(slots[s] + i * 4, 1)[0]);
        if (got != want[i]) {
          problem(fmt::format("{}: element {} is {}, expected exactly {}", slotName, i, got, want[i]));
          break;
        }
      }
      continue;
    }
    double errSq = 0, refSq = 0, worst = -1;
    std::size_t worstAt = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      const double got = loadElement(slots[s], t, i);
      if (!std::isfinite(got)) {
        problem(fmt::format("{}: element {} is {} (expected {}); unwritten or overflowed", slotName, i, got, want[i]));
        errSq = std::numeric_limits<double>::quiet_NaN();
        break;
      }
      const double diff = got - want[i];
      errSq += diff * diff;
      refSq += want[i] * want[i];
      if (std::abs(diff) > worst) {
        worst = std::abs(diff);
        worstAt = i;
      }
    }
    // An all-zero reference has no scale: fall back to the absolute error.
    const double rel = std::sqrt(errSq) / (refSq > 0 ? std::sqrt(refSq) : 1.0);
    if (std::isnan(rel) || rel > result.relError) result.relError = rel;  // the worst slot; NaN sticks
    if (!(rel <= result.tolerance)) {
      problem(fmt::format("{}: relative error {:.3g} > tolerance {:.3g} (worst element {}: got {}, expected {})",
                          slotName, rel, result.tolerance, worstAt, loadElement(slots[s], t, worstAt), want[worstAt]));
    }
  }
  result.ok = problems.empty();
  result.detail = std::move(problems);
  return result;
}

}  // namespace tandem::reference
