// The CPU backend's ops. Each op first converts every input it needs to fp32 (once), checks the data
// (expert ids, capacities), and only then writes outputs, so a failing op leaves every output untouched.
// Every loop has a fixed order and there is no threading, so the same inputs give bitwise the same
// outputs on every run.
#include "cpu/cpu_ops.hpp"

#include "tandem/common/op_spec.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "tandem/common/error.hpp"
#include "tandem/common/numeric.hpp"

namespace tandem::daemon {
namespace {

using Floats = std::vector<float>;

Floats load(const std::byte* p, DType dtype, std::size_t count) {
  Floats v(count);
  if (count != 0) loadElements(p, dtype, count, v.data());
  return v;
}

void store(std::byte* p, DType dtype, const float* values, std::size_t count) {
  if (count != 0) storeElements(p, dtype, count, values);
}

// Dot product of two contiguous fp32 rows with eight interleaved partial sums, combined in a fixed tree:
// deterministic, and independent partial sums let the compiler keep eight lanes in flight.
inline float dot(const float* x, const float* y, std::size_t k) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::size_t i = 0;
  for (; i + 8 <= k; i += 8)
    for (std::size_t l = 0; l < 8; ++l) acc[l] += x[i + l] * y[i + l];
  float tail = 0;
  for (; i < k; ++i) tail += x[i] * y[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

// A GEMM operand as [rows, k] (K-major) in fp32, from its storage: [k, rows] when `transposed` (kFlagGemmLayout),
// so every layout runs on gemmNT.
Floats loadKMajor(const std::byte* p, DType dtype, std::size_t rows, std::size_t k, bool transposed) {
  Floats v = load(p, dtype, rows * k);
  if (!transposed) return v;
  Floats out(rows * k);
  for (std::size_t p2 = 0; p2 < k; ++p2)
    for (std::size_t i = 0; i < rows; ++i) out[i * k + p2] = v[p2 * rows + i];
  return out;
}

}  // namespace

// c[m, n] = a[m, k] · b[n, k]ᵀ in fp32. Both operands are K-major, so every output is one contiguous dot
// product. Columns are taken in blocks whose rows of b stay in cache while every row of a passes by.
void gemmNT(const float* a, const float* b, float* c, std::size_t m, std::size_t n, std::size_t k) {
  // 96 KiB of b per block: fits L2 comfortably next to a row of a.
  const std::size_t block = std::max<std::size_t>(1, (96 * 1024 / sizeof(float)) / std::max<std::size_t>(k, 1));
  for (std::size_t j0 = 0; j0 < n; j0 += block) {
    const std::size_t j1 = std::min(n, j0 + block);
    for (std::size_t i = 0; i < m; ++i) {
      const float* ai = a + i * k;
      float* ci = c + i * n;
      for (std::size_t j = j0; j < j1; ++j) ci[j] = dot(ai, b + j * k, k);
    }
  }
}

Floats gemmOperand(const RankOp& r, bool isB, std::size_t rows, std::size_t k) {
  const OpDescriptor& d = r.desc;
  const GemmOperands layout = gemmOperandsOf(d.flags);
  const bool transposed = isB ? !bKMajor(layout) : aTransposed(layout);
  Floats v = loadKMajor(r.data[isB ? slot::kB : slot::kA], d.dtype, rows, k, transposed);
  if (!isFp8(d.dtype) || rows * k == 0) return v;
  const int s = gemmScaleSlot(d.kind, isB);
  const Floats scale = load(r.data[s], DType::kF32, d.bufs[static_cast<std::size_t>(s)].bytes / sizeof(float));
  if ((d.flags & kFlagFp8BlockScale) == 0) {
    for (float& x : v) x *= scale[0];
    return v;
  }
  const std::size_t kBlocks = (k + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  for (std::size_t i = 0; i < rows; ++i) {
    float* row = v.data() + i * k;
    for (std::size_t p = 0; p < k; ++p) {
      const std::size_t kb = p / kFp8ScaleBlock;
      row[p] *= isB ? scale[(i / kFp8ScaleBlock) * kBlocks + kb] : scale[kb * rows + i];
    }
  }
  return v;
}

namespace {

void requireMemory(std::span<const RankOp> ranks, int s) {
  for (const RankOp& r : ranks) {
    const auto i = static_cast<std::size_t>(s);
    if (r.data[i] == nullptr && r.desc.bufs[i].bytes != 0) {
      fail(ErrorCode::kInternal, "cpu backend {}: rank {} slot {} ({} bytes) has no mapped memory",
           opKindName(r.desc.kind), r.desc.rank, s, r.desc.bufs[i].bytes);
    }
  }
}

void requireScales(std::span<const RankOp> ranks) {
  if (!isFp8(ranks[0].desc.dtype)) return;
  requireMemory(ranks, gemmScaleSlot(ranks[0].desc.kind, false));
  requireMemory(ranks, gemmScaleSlot(ranks[0].desc.kind, true));
}

// ---- ag-gemm ----------------------------------------------------------------------------------------

void agGemm(std::span<const RankOp> ranks) {
  const auto n = static_cast<uint32_t>(ranks.size());
  const OpDescriptor& d0 = ranks[0].desc;
  const DType dtype = d0.dtype;
  const std::size_t m = d0.dims[dim::kM], nCols = d0.dims[dim::kN], k = d0.dims[dim::kK];
  const std::size_t es = dtypeSize(dtype);
  requireMemory(ranks, slot::kA);
  requireMemory(ranks, slot::kB);
  requireMemory(ranks, slot::kC);
  requireScales(ranks);
  const DType out = gemmOutDtype(dtype, d0.flags);

  // Gather op(A) once, in fp32 (dequantized), before any output is touched.
  Floats a(m * k);
  for (uint32_t r = 0; r < n; ++r) {
    const std::size_t rows = rowsOf(m, r, n);
    if (rows == 0) continue;
    const Floats shard = gemmOperand(ranks[r], false, rows, k);
    std::copy(shard.begin(), shard.end(), a.begin() + static_cast<std::ptrdiff_t>(rowOffset(m, r, n) * k));
  }
  std::vector<Floats> b(n);
  for (uint32_t r = 0; r < n; ++r) b[r] = gemmOperand(ranks[r], true, nCols, k);

  Floats c(m * nCols);
  for (uint32_t r = 0; r < n; ++r) {
    gemmNT(a.data(), b[r].data(), c.data(), m, nCols, k);
    store(ranks[r].data[slot::kC], out, c.data(), m * nCols);
    if (std::byte* gathered = ranks[r].data[slot::kAGathered]; gathered != nullptr) {
      // The shards are copied bit for bit, as stored (in every layout a_gathered is the shards in rank order).
      for (uint32_t src = 0; src < n; ++src) {
        const std::size_t rows = rowsOf(m, src, n);
        if (rows != 0) std::memcpy(gathered + rowOffset(m, src, n) * k * es, ranks[src].data[slot::kA], rows * k * es);
      }
    }
  }
}

// ---- gemm-rs / gemm-ar ------------------------------------------------------------------------------

void gemmReduce(std::span<const RankOp> ranks) {
  const auto n = static_cast<uint32_t>(ranks.size());
  const OpDescriptor& d0 = ranks[0].desc;
  const DType dtype = d0.dtype;
  const std::size_t m = d0.dims[dim::kM], nCols = d0.dims[dim::kN];
  requireMemory(ranks, slot::kA);
  requireMemory(ranks, slot::kB);
  requireMemory(ranks, slot::kC);
  requireScales(ranks);
  const DType out = gemmOutDtype(dtype, d0.flags);

  // C = Σ_r op(a_r) · op(b_r): each rank's partial in fp32, summed in rank order (the reduction order is fixed).
  Floats c(m * nCols, 0.0f), partial(m * nCols);
  for (uint32_t r = 0; r < n; ++r) {
    const std::size_t k = ranks[r].desc.dims[dim::kK];
    const Floats a = gemmOperand(ranks[r], false, m, k);
    const Floats b = gemmOperand(ranks[r], true, nCols, k);
    gemmNT(a.data(), b.data(), partial.data(), m, nCols, k);
    for (std::size_t i = 0; i < c.size(); ++i) c[i] += partial[i];
  }
  for (uint32_t r = 0; r < n; ++r) {
    if (d0.kind == OpKind::kGemmAr) {
      store(ranks[r].data[slot::kC], out, c.data(), m * nCols);
    } else {
      store(ranks[r].data[slot::kC], out, c.data() + rowOffset(m, r, n) * nCols, rowsOf(m, r, n) * nCols);
    }
  }
}

// ---- MoE ----------------------------------------------------------------------------------------------

struct Route {
  uint32_t srcRank;
  uint32_t slotIndex;
  uint64_t token;
};

// Reads every rank's top-k ids, checks them and groups the (token, slot) pairs by global expert, each
// group in (source rank, token, slot) order: the row order tandem.h specifies.
std::vector<std::vector<Route>> routeTokens(std::span<const RankOp> ranks) {
  const OpDescriptor& d0 = ranks[0].desc;
  const std::string_view kind = opKindName(d0.kind);
  const uint64_t experts = d0.dims[dim::kExperts], topk = d0.dims[dim::kTopk];
  std::vector<std::vector<Route>> routes(experts);
  std::vector<int32_t> ids;
  for (uint32_t s = 0; s < ranks.size(); ++s) {
    const uint64_t tokens = ranks[s].desc.dims[dim::kTokens];
    ids.resize(tokens * topk);
    if (!ids.empty()) std::memcpy(ids.data(), ranks[s].data[slot::kTopkIds], ids.size() * sizeof(int32_t));
    for (uint64_t t = 0; t < tokens; ++t) {
      const int32_t* row = ids.data() + t * topk;
      for (uint64_t j = 0; j < topk; ++j) {
        if (row[j] < 0 || static_cast<uint64_t>(row[j]) >= experts) {
          fail(ErrorCode::kInvalidArgument,
               "{}: rank {} topk_ids[{}][{}] = {} is out of range [0, {}); pass expert ids in [0, experts)", kind, s,
               t, j, row[j], experts);
        }
        for (uint64_t j2 = 0; j2 < j; ++j2) {
          if (row[j2] == row[j]) {
            fail(ErrorCode::kInvalidArgument,
                 "{}: rank {} token {} names expert {} twice (topk_ids[{}][{}] and [{}][{}]); a token's top-k experts "
                 "must be distinct",
                 kind, s, t, row[j], t, j2, t, j);
          }
        }
        routes[static_cast<std::size_t>(row[j])].push_back({s, static_cast<uint32_t>(j), t});
      }
    }
  }
  return routes;
}

// The routed rows of one expert, gathered into a dense fp32 matrix [routes.size(), hidden].
Floats gatherRows(const std::vector<Route>& routes, const std::vector<Floats>& x, std::size_t hidden) {
  Floats rows(routes.size() * hidden);
  for (std::size_t i = 0; i < routes.size(); ++i) {
    const Route& rt = routes[i];
    std::copy_n(x[rt.srcRank].data() + rt.token * hidden, hidden, rows.data() + i * hidden);
  }
  return rows;
}

std::vector<Floats> loadTokens(std::span<const RankOp> ranks, std::size_t hidden) {
  std::vector<Floats> x(ranks.size());
  for (std::size_t s = 0; s < ranks.size(); ++s) {
    x[s] = load(ranks[s].data[slot::kX], ranks[s].desc.dtype, ranks[s].desc.dims[dim::kTokens] * hidden);
  }
  return x;
}

// The FFN ops' saved gate|up (tandem.h): rank d's saved holds one [a | b] row of 2 * ffn per row routed to its
// experts, in the op's row order, so it must hold every such row. Checked for every rank before anything is written.
// Returns the saved slot's pointer per rank (null: that rank saves nothing, saved_rows 0).
std::vector<std::byte*> savedGateUp(std::span<const RankOp> ranks, int savedSlot,
                                    const std::vector<std::vector<Route>>& routes) {
  const auto n = static_cast<uint32_t>(ranks.size());
  const std::size_t local = ranks[0].desc.dims[dim::kExperts] / n;
  requireMemory(ranks, savedSlot);
  std::vector<std::byte*> saved(n, nullptr);
  for (uint32_t d = 0; d < n; ++d) {
    const uint64_t capacity = ranks[d].desc.dims[dim::kSavedRows];
    if (capacity == 0) continue;
    std::size_t rows = 0;
    for (std::size_t le = 0; le < local; ++le) rows += routes[d * local + le].size();
    if (rows > capacity) {
      fail(ErrorCode::kInvalidArgument,
           "{}: rank {} receives {} rows but its saved tensor holds saved_rows = {}; nothing was written: pass "
           "saved_rows >= {} with saved [saved_rows, 2*ffn] (at most nranks * tokens * topk rows)",
           opKindName(ranks[d].desc.kind), d, rows, capacity, rows);
    }
    saved[d] = ranks[d].data[static_cast<std::size_t>(savedSlot)];
  }
  return saved;
}

// The MoE ops' FP8 activations (tandem.h): each row of `v` ([rows, cols]) quantised to e4m3 per 1 x 128 block and
// replaced by its dequantised values.
void quantizeRows(Floats& v, std::size_t cols) {
  for (std::size_t row = 0; row * cols < v.size(); ++row) {
    for (std::size_t c = 0; c < cols; c += kFp8ScaleBlock) {
      float* block = v.data() + row * cols + c;
      quantizeE4m3Block(block, std::min<std::size_t>(kFp8ScaleBlock, cols - c), block);
    }
  }
}

// Rank `r`'s expert weights [local, rows, cols] in fp32: slot `s` (w, w1 or w2) in w_dtype, FP8 ones multiplied by
// their 128 x 128 block scales (slot `scaleSlot`, [local, ceil(rows/128), ceil(cols/128)]).
Floats loadExpertWeights(const RankOp& r, int s, int scaleSlot, std::size_t local, std::size_t rows,
                         std::size_t cols) {
  const DType wdt = moeWeightDtype(r.desc.dtype, r.desc.flags);
  Floats w = load(r.data[s], wdt, local * rows * cols);
  if (!isFp8(wdt)) return w;
  const std::size_t rb = (rows + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  const std::size_t cb = (cols + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  const Floats scale = load(r.data[scaleSlot], DType::kF32, local * rb * cb);
  for (std::size_t e = 0; e < local; ++e)
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t p = 0; p < cols; ++p) {
        w[(e * rows + i) * cols + p] *= scale[(e * rb + i / kFp8ScaleBlock) * cb + p / kFp8ScaleBlock];
      }
  return w;
}

void moeDispatchGemm(std::span<const RankOp> ranks) {
  const auto n = static_cast<uint32_t>(ranks.size());
  const OpDescriptor& d0 = ranks[0].desc;
  const DType dtype = d0.dtype;
  const bool fp8 = isFp8(moeWeightDtype(dtype, d0.flags));
  const std::size_t hidden = d0.dims[dim::kHidden], nOut = d0.dims[dim::kNOut];
  const std::size_t local = d0.dims[dim::kExperts] / n;
  for (int s : {slot::kX, slot::kTopkIds, slot::kW, slot::kMoeOut, slot::kRowInfo, slot::kExpertCounts}) {
    requireMemory(ranks, s);
  }
  if (fp8) requireMemory(ranks, slot::kMoeWScale);

  const std::vector<std::vector<Route>> routes = routeTokens(ranks);
  for (uint32_t d = 0; d < n; ++d) {
    std::size_t rows = 0;
    for (std::size_t le = 0; le < local; ++le) rows += routes[d * local + le].size();
    const uint64_t capacity = ranks[d].desc.dims[dim::kCapacity];
    if (rows > capacity) {
      fail(ErrorCode::kInvalidArgument, "moe-dispatch-gemm: rank {} receives {} rows but capacity is {}; pass capacity >= {}",
           d, rows, capacity, rows);
    }
  }

  std::vector<Floats> x = loadTokens(ranks, hidden);
  if (fp8) {  // quantised once per token, on its own rank (tandem.h)
    for (Floats& xs : x) quantizeRows(xs, hidden);
  }
  std::vector<Floats> w(n);
  for (uint32_t d = 0; d < n; ++d) w[d] = loadExpertWeights(ranks[d], slot::kW, slot::kMoeWScale, local, nOut, hidden);

  // Every check has passed and every input is read: now write.
  const std::size_t es = dtypeSize(dtype);
  Floats y;
  for (uint32_t d = 0; d < n; ++d) {
    std::size_t row = 0;
    for (std::size_t le = 0; le < local; ++le) {
      const std::size_t e = d * local + le;
      const std::vector<Route>& group = routes[e];
      const Floats xe = gatherRows(group, x, hidden);
      y.resize(group.size() * nOut);
      gemmNT(xe.data(), w[d].data() + le * nOut * hidden, y.data(), group.size(), nOut, hidden);
      store(ranks[d].data[slot::kMoeOut] + row * nOut * es, dtype, y.data(), y.size());
      for (std::size_t i = 0; i < group.size(); ++i) {
        const int32_t info[4] = {static_cast<int32_t>(group[i].srcRank), static_cast<int32_t>(group[i].token),
                                 static_cast<int32_t>(group[i].slotIndex), static_cast<int32_t>(e)};
        std::memcpy(ranks[d].data[slot::kRowInfo] + (row + i) * sizeof(info), info, sizeof(info));
      }
      const auto count = static_cast<int32_t>(group.size());
      std::memcpy(ranks[d].data[slot::kExpertCounts] + le * sizeof(int32_t), &count, sizeof(int32_t));
      row += group.size();
    }
  }
}

void moeDispatchFfnCombine(std::span<const RankOp> ranks) {
  const auto n = static_cast<uint32_t>(ranks.size());
  const OpDescriptor& d0 = ranks[0].desc;
  const DType dtype = d0.dtype;
  const bool fp8 = isFp8(moeWeightDtype(dtype, d0.flags));
  const std::size_t hidden = d0.dims[dim::kHidden], ffn = d0.dims[dim::kFfn], topk = d0.dims[dim::kTopk];
  const std::size_t local = d0.dims[dim::kExperts] / n;
  for (int s : {slot::kX, slot::kTopkIds, slot::kTopkWeights, slot::kW1, slot::kW2, slot::kFfnOut}) {
    requireMemory(ranks, s);
  }
  if (fp8) {
    requireMemory(ranks, slot::kFfnW1Scale);
    requireMemory(ranks, slot::kFfnW2Scale);
  }

  const std::vector<std::vector<Route>> routes = routeTokens(ranks);
  const std::vector<std::byte*> saved = savedGateUp(ranks, slot::kFfnSaved, routes);
  std::vector<Floats> x = loadTokens(ranks, hidden);
  if (fp8) {  // quantised once per token, on its own rank
    for (Floats& xs : x) quantizeRows(xs, hidden);
  }
  std::vector<Floats> weights(n), y(n);
  for (uint32_t s = 0; s < n; ++s) {
    const std::size_t tokens = ranks[s].desc.dims[dim::kTokens];
    weights[s] = load(ranks[s].data[slot::kTopkWeights], DType::kF32, tokens * topk);
    y[s].assign(tokens * topk * hidden, 0.0f);  // y of every (token, slot), kept in fp32 for the combine
  }

  // Expert side: gemm1, SwiGLU (h rounded to dtype once, as tandem.h says; FP8: quantised per 1 x 128 block), gemm2.
  // A rank that saves gate|up rounds it to dtype, stores it at its rows and takes h from the rounded values, as its
  // backward will.
  const std::size_t es = dtypeSize(dtype);
  Floats gateUp, h, ye;
  for (uint32_t d = 0; d < n; ++d) {
    const Floats w1 = loadExpertWeights(ranks[d], slot::kW1, slot::kFfnW1Scale, local, 2 * ffn, hidden);
    const Floats w2 = loadExpertWeights(ranks[d], slot::kW2, slot::kFfnW2Scale, local, hidden, ffn);
    std::size_t savedRow = 0;
    for (std::size_t le = 0; le < local; ++le) {
      const std::vector<Route>& group = routes[d * local + le];
      if (group.empty()) continue;
      const std::size_t rows = group.size();
      const Floats xe = gatherRows(group, x, hidden);
      gateUp.resize(rows * 2 * ffn);
      gemmNT(xe.data(), w1.data() + le * 2 * ffn * hidden, gateUp.data(), rows, 2 * ffn, hidden);
      if (saved[d] != nullptr) {
        for (float& v : gateUp) v = roundTo(dtype, v);
        store(saved[d] + savedRow * 2 * ffn * es, dtype, gateUp.data(), gateUp.size());
        savedRow += rows;
      }
      h.resize(rows * ffn);
      for (std::size_t i = 0; i < rows; ++i) {
        for (std::size_t f = 0; f < ffn; ++f) {
          const float gate = gateUp[i * 2 * ffn + f], up = gateUp[i * 2 * ffn + ffn + f];
          const float silu = gate / (1.0f + std::exp(-gate));
          h[i * ffn + f] = fp8 ? silu * up : roundTo(dtype, silu * up);
        }
      }
      if (fp8) quantizeRows(h, ffn);
      ye.resize(rows * hidden);
      gemmNT(h.data(), w2.data() + le * hidden * ffn, ye.data(), rows, hidden, ffn);
      for (std::size_t i = 0; i < rows; ++i) {
        const Route& rt = group[i];
        std::copy_n(ye.data() + i * hidden, hidden, y[rt.srcRank].data() + (rt.token * topk + rt.slotIndex) * hidden);
      }
    }
  }

  // Source side: the weighted combine in slot order, rounded once.
  Floats out;
  for (uint32_t s = 0; s < n; ++s) {
    const std::size_t tokens = ranks[s].desc.dims[dim::kTokens];
    out.assign(tokens * hidden, 0.0f);
    for (std::size_t t = 0; t < tokens; ++t) {
      float* o = out.data() + t * hidden;
      for (std::size_t j = 0; j < topk; ++j) {
        const float weight = weights[s][t * topk + j];
        const float* yj = y[s].data() + (t * topk + j) * hidden;
        for (std::size_t c = 0; c < hidden; ++c) o[c] += weight * yj[c];
      }
    }
    store(ranks[s].data[slot::kFfnOut], dtype, out.data(), out.size());
  }
}

// The backward of moeDispatchFfnCombine (tandem.h), in fp32. Expert side: each local expert's rows (in (source rank,
// token, slot) order) are gathered with their dout rows, a and b read from the forward's saved rows or recomputed as
// the forward computes them, h from them, then per row u = dout w2, dtopk_weight = u.h, dh = weight * u, da and db; dx
// of the row is [da; db] w1, and dw1, dw2 grow by one outer product per row in row order. Source side: dx sums the
// token's slots in slot order. Every sum has one fixed order, so the outputs repeat bit for bit.
void moeFfnBackward(std::span<const RankOp> ranks) {
  const auto n = static_cast<uint32_t>(ranks.size());
  const OpDescriptor& d0 = ranks[0].desc;
  const DType dtype = d0.dtype;
  const std::size_t hidden = d0.dims[dim::kHidden], ffn = d0.dims[dim::kFfn], topk = d0.dims[dim::kTopk];
  const std::size_t local = d0.dims[dim::kExperts] / n;
  for (int s : {slot::kX, slot::kTopkIds, slot::kTopkWeights, slot::kW1, slot::kW2, slot::kMoeDout, slot::kMoeDx,
                slot::kMoeDtopkWeights, slot::kMoeDw1, slot::kMoeDw2}) {
    requireMemory(ranks, s);
  }

  const std::vector<std::vector<Route>> routes = routeTokens(ranks);
  const std::vector<std::byte*> saved = savedGateUp(ranks, slot::kMoeBwdSaved, routes);
  const std::vector<Floats> x = loadTokens(ranks, hidden);
  std::vector<Floats> weights(n), dout(n), dxSlots(n), dweights(n), dw1(n), dw2(n);
  for (uint32_t s = 0; s < n; ++s) {
    const std::size_t tokens = ranks[s].desc.dims[dim::kTokens];
    weights[s] = load(ranks[s].data[slot::kTopkWeights], DType::kF32, tokens * topk);
    dout[s] = load(ranks[s].data[slot::kMoeDout], dtype, tokens * hidden);
    dxSlots[s].assign(tokens * topk * hidden, 0.0f);  // dx of every (token, slot), summed on the source side
    dweights[s].assign(tokens * topk, 0.0f);
  }

  Floats gateUp, h, u, dGateUp;
  const std::size_t es = dtypeSize(dtype);
  for (uint32_t d = 0; d < n; ++d) {
    const Floats w1 = load(ranks[d].data[slot::kW1], dtype, local * 2 * ffn * hidden);
    const Floats w2 = load(ranks[d].data[slot::kW2], dtype, local * hidden * ffn);
    dw1[d].assign(w1.size(), 0.0f);
    dw2[d].assign(w2.size(), 0.0f);
    std::size_t savedRow = 0;
    for (std::size_t le = 0; le < local; ++le) {
      const std::vector<Route>& group = routes[d * local + le];
      if (group.empty()) continue;
      const std::size_t rows = group.size();
      const float* w1e = w1.data() + le * 2 * ffn * hidden;
      const float* w2e = w2.data() + le * hidden * ffn;
      float* dw1e = dw1[d].data() + le * 2 * ffn * hidden;
      float* dw2e = dw2[d].data() + le * hidden * ffn;
      const Floats xe = gatherRows(group, x, hidden);
      const Floats ge = gatherRows(group, dout, hidden);
      if (saved[d] != nullptr) {  // the forward's rows, in the same order
        gateUp = load(saved[d] + savedRow * 2 * ffn * es, dtype, rows * 2 * ffn);
        savedRow += rows;
      } else {
        gateUp.resize(rows * 2 * ffn);
        gemmNT(xe.data(), w1e, gateUp.data(), rows, 2 * ffn, hidden);
      }
      h.resize(ffn);
      u.resize(ffn);
      dGateUp.resize(2 * ffn);
      for (std::size_t i = 0; i < rows; ++i) {
        const Route& rt = group[i];
        const float weight = weights[rt.srcRank][rt.token * topk + rt.slotIndex];
        const float* a = gateUp.data() + i * 2 * ffn;
        const float* b = a + ffn;
        const float* xi = xe.data() + i * hidden;
        const float* gi = ge.data() + i * hidden;
        for (std::size_t f = 0; f < ffn; ++f) h[f] = roundTo(dtype, a[f] / (1.0f + std::exp(-a[f])) * b[f]);
        // u = dout_t w2, over w2's rows in order.
        std::fill(u.begin(), u.end(), 0.0f);
        for (std::size_t o = 0; o < hidden; ++o) {
          const float* w2o = w2e + o * ffn;
          for (std::size_t f = 0; f < ffn; ++f) u[f] += gi[o] * w2o[f];
        }
        dweights[rt.srcRank][rt.token * topk + rt.slotIndex] = dot(u.data(), h.data(), ffn);
        for (std::size_t f = 0; f < ffn; ++f) {
          const float dh = weight * u[f];
          const float sig = 1.0f / (1.0f + std::exp(-a[f]));
          dGateUp[f] = dh * b[f] * sig * (1.0f + a[f] * (1.0f - sig));
          dGateUp[ffn + f] = dh * a[f] * sig;
        }
        // dx of this (token, slot) = [da; db] w1, over w1's rows in order.
        float* dxi = dxSlots[rt.srcRank].data() + (rt.token * topk + rt.slotIndex) * hidden;
        for (std::size_t k = 0; k < 2 * ffn; ++k) {
          const float gk = dGateUp[k];
          const float* w1k = w1e + k * hidden;
          float* dw1k = dw1e + k * hidden;
          for (std::size_t c = 0; c < hidden; ++c) {
            dxi[c] += gk * w1k[c];
            dw1k[c] += gk * xi[c];
          }
        }
        for (std::size_t o = 0; o < hidden; ++o) {
          const float go = weight * gi[o];
          float* dw2o = dw2e + o * ffn;
          for (std::size_t f = 0; f < ffn; ++f) dw2o[f] += go * h[f];
        }
      }
    }
  }

  // Every input is read: now write. dx sums each token's slots in slot order.
  Floats dx;
  for (uint32_t s = 0; s < n; ++s) {
    const std::size_t tokens = ranks[s].desc.dims[dim::kTokens];
    dx.assign(tokens * hidden, 0.0f);
    for (std::size_t t = 0; t < tokens; ++t) {
      float* o = dx.data() + t * hidden;
      for (std::size_t j = 0; j < topk; ++j) {
        const float* part = dxSlots[s].data() + (t * topk + j) * hidden;
        for (std::size_t c = 0; c < hidden; ++c) o[c] += part[c];
      }
    }
    store(ranks[s].data[slot::kMoeDx], dtype, dx.data(), dx.size());
    store(ranks[s].data[slot::kMoeDtopkWeights], DType::kF32, dweights[s].data(), dweights[s].size());
    store(ranks[s].data[slot::kMoeDw1], dtype, dw1[s].data(), dw1[s].size());
    store(ranks[s].data[slot::kMoeDw2], dtype, dw2[s].data(), dw2[s].size());
  }
}

// ---- ring attention -----------------------------------------------------------------------------------

// Mirrors the GPU algorithm: each rank keeps its query blocks and sees the KV chunks in ring order (its
// own first, then the chunk of rank r-1, r-2, ...), folding each into an online softmax (running max,
// running sum, rescaled accumulator) as FlashAttention does. A rank's rows are one run of consecutive global
// positions (contiguous layout) or two (zigzag: chunks r and 2n-1-r); causal skips whole runs in a block's future.
struct AttnRun {
  std::size_t local, global, rows;  // rows [local, local + rows) of the rank sit at global positions global ...
};

std::vector<std::vector<AttnRun>> attentionRuns(std::span<const RankOp> ranks, bool zigzag) {
  const auto n = static_cast<uint32_t>(ranks.size());
  std::vector<std::vector<AttnRun>> runs(n);
  std::size_t pos = 0;
  if (!zigzag) {
    for (uint32_t r = 0; r < n; ++r) {
      const std::size_t seq = ranks[r].desc.dims[dim::kSeq];
      runs[r].push_back({0, pos, seq});
      pos += seq;
    }
    return runs;
  }
  for (uint32_t c = 0; c < 2 * n; ++c) {  // chunk c < n: rank c's first ceil(seq / 2) rows; c >= n: the rest
    const uint32_t r = c < n ? c : 2 * n - 1 - c;
    const std::size_t seq = ranks[r].desc.dims[dim::kSeq], first = seq - seq / 2;
    const AttnRun run = c < n ? AttnRun{0, pos, first} : AttnRun{first, pos, seq - first};
    runs[r].push_back(run);
    pos += run.rows;
  }
  return runs;
}

void ringAttention(std::span<const RankOp> ranks) {
  const auto n = static_cast<uint32_t>(ranks.size());
  const OpDescriptor& d0 = ranks[0].desc;
  const DType dtype = d0.dtype;
  const std::size_t heads = d0.dims[dim::kHeads], headDim = d0.dims[dim::kHeadDim];
  const std::size_t kvHeads = d0.dims[dim::kKvHeads], group = heads / kvHeads;  // query heads per KV head
  const bool causal = (d0.flags & kFlagCausal) != 0;
  const float scale = d0.scale != 0.0f ? d0.scale : 1.0f / std::sqrt(static_cast<float>(headDim));
  for (int s : {slot::kQ, slot::kKey, slot::kValue, slot::kAttnOut}) requireMemory(ranks, s);
  const std::vector<std::vector<AttnRun>> runs = attentionRuns(ranks, (d0.flags & kFlagZigzag) != 0);

  std::vector<Floats> q(n), k(n), v(n);
  std::vector<std::size_t> seq(n);
  for (uint32_t r = 0; r < n; ++r) {
    seq[r] = ranks[r].desc.dims[dim::kSeq];
    q[r] = load(ranks[r].data[slot::kQ], dtype, seq[r] * heads * headDim);
    k[r] = load(ranks[r].data[slot::kKey], dtype, seq[r] * kvHeads * headDim);
    v[r] = load(ranks[r].data[slot::kValue], dtype, seq[r] * kvHeads * headDim);
  }

  constexpr std::size_t kBlockRows = 16;  // query rows per block, as one CTA tile would hold
  const std::size_t stride = heads * headDim, kvStride = kvHeads * headDim;
  Floats out, lse, scores, acc(kBlockRows * headDim);
  float rowMax[kBlockRows], rowSum[kBlockRows];
  for (uint32_t r = 0; r < n; ++r) {
    out.assign(seq[r] * stride, 0.0f);
    lse.assign(seq[r] * heads, 0.0f);
    for (std::size_t h = 0; h < heads; ++h) {
      const std::size_t kvCol = (h / group) * headDim;
      for (const AttnRun& qr : runs[r]) {
        for (std::size_t b0 = 0; b0 < qr.rows; b0 += kBlockRows) {
          const std::size_t rows = std::min(kBlockRows, qr.rows - b0);
          const std::size_t i0 = qr.local + b0;           // the block's first local row
          const std::size_t firstQuery = qr.global + b0;  // and its global position
          std::fill_n(rowMax, rows, -std::numeric_limits<float>::infinity());
          std::fill_n(rowSum, rows, 0.0f);
          std::fill(acc.begin(), acc.end(), 0.0f);
          const std::size_t lastQuery = firstQuery + rows - 1;
          for (uint32_t step = 0; step < n; ++step) {
            const uint32_t src = (r + n - step) % n;
            for (const AttnRun& kr : runs[src]) {
              if (kr.rows == 0) continue;
              if (causal && kr.global > lastQuery) continue;  // the whole run lies in this block's future
              scores.resize(kr.rows);
              for (std::size_t i = 0; i < rows; ++i) {
                const std::size_t queryPos = firstQuery + i;
                // Keys of this run that row i may see: all, or those at global positions <= queryPos.
                std::size_t keys = kr.rows;
                if (causal) keys = queryPos < kr.global ? 0 : std::min(keys, queryPos - kr.global + 1);
                if (keys == 0) continue;
                const float* qi = q[r].data() + (i0 + i) * stride + h * headDim;
                float chunkMax = -std::numeric_limits<float>::infinity();
                for (std::size_t j = 0; j < keys; ++j) {
                  scores[j] = dot(qi, k[src].data() + (kr.local + j) * kvStride + kvCol, headDim) * scale;
                  chunkMax = std::max(chunkMax, scores[j]);
                }
                const float newMax = std::max(rowMax[i], chunkMax);
                const float correction = std::exp(rowMax[i] - newMax);  // 0 on the first chunk (max was -inf)
                float* a = acc.data() + i * headDim;
                rowSum[i] *= correction;
                for (std::size_t c = 0; c < headDim; ++c) a[c] *= correction;
                for (std::size_t j = 0; j < keys; ++j) {
                  const float p = std::exp(scores[j] - newMax);
                  rowSum[i] += p;
                  const float* vj = v[src].data() + (kr.local + j) * kvStride + kvCol;
                  for (std::size_t c = 0; c < headDim; ++c) a[c] += p * vj[c];
                }
                rowMax[i] = newMax;
              }
            }
          }
          for (std::size_t i = 0; i < rows; ++i) {
            // NOTE: rowSum >= 1 here: a causal row sees at least itself, a non-causal row every key.
            const float inv = 1.0f / rowSum[i];
            float* o = out.data() + (i0 + i) * stride + h * headDim;
            for (std::size_t c = 0; c < headDim; ++c) o[c] = acc[i * headDim + c] * inv;
            lse[h * seq[r] + i0 + i] = rowMax[i] + std::log(rowSum[i]);
          }
        }
      }
    }
    // Outputs are written only after all ranks' inputs were read (above), so nothing an op writes can
    // feed a later rank's computation.
    store(ranks[r].data[slot::kAttnOut], dtype, out.data(), out.size());
    if (ranks[r].data[slot::kAttnLse] != nullptr && !lse.empty()) {
      store(ranks[r].data[slot::kAttnLse], DType::kF32, lse.data(), lse.size());
    }
  }
}

// The backward of ringAttention from the forward's out and lse (tandem.h), FlashAttention's recomputation in fp32:
// each rank's query rows against every rank's KV runs in rank order, P = exp(scale q.k - lse), D = dout.out,
// dS = P (dout.v - D); dq sums dS k over the keys, and every KV row's dk (dS q) and dv (P dout) over the query rows of
// rank 0, 1, ... in turn, a fixed order, so the outputs repeat bit for bit.
void ringAttentionBackward(std::span<const RankOp> ranks) {
  const auto n = static_cast<uint32_t>(ranks.size());
  const OpDescriptor& d0 = ranks[0].desc;
  const DType dtype = d0.dtype;
  const std::size_t heads = d0.dims[dim::kHeads], hd = d0.dims[dim::kHeadDim];
  const std::size_t kvHeads = d0.dims[dim::kKvHeads], group = heads / kvHeads;
  const bool causal = (d0.flags & kFlagCausal) != 0;
  const float scale = d0.scale != 0.0f ? d0.scale : 1.0f / std::sqrt(static_cast<float>(hd));
  for (int s : {slot::kQ, slot::kKey, slot::kValue, slot::kAttnOut, slot::kDout, slot::kBwdLse, slot::kDq, slot::kDk,
                slot::kDv}) {
    requireMemory(ranks, s);
  }
  const std::vector<std::vector<AttnRun>> runs = attentionRuns(ranks, (d0.flags & kFlagZigzag) != 0);
  std::vector<Floats> q(n), k(n), v(n), o(n), dout(n), lse(n), dq(n), dk(n), dv(n);
  std::vector<std::size_t> seq(n);
  for (uint32_t r = 0; r < n; ++r) {
    seq[r] = ranks[r].desc.dims[dim::kSeq];
    q[r] = load(ranks[r].data[slot::kQ], dtype, seq[r] * heads * hd);
    o[r] = load(ranks[r].data[slot::kAttnOut], dtype, seq[r] * heads * hd);
    dout[r] = load(ranks[r].data[slot::kDout], dtype, seq[r] * heads * hd);
    lse[r] = load(ranks[r].data[slot::kBwdLse], DType::kF32, heads * seq[r]);
    k[r] = load(ranks[r].data[slot::kKey], dtype, seq[r] * kvHeads * hd);
    v[r] = load(ranks[r].data[slot::kValue], dtype, seq[r] * kvHeads * hd);
    dq[r].assign(seq[r] * heads * hd, 0.0f);
    dk[r].assign(seq[r] * kvHeads * hd, 0.0f);
    dv[r].assign(seq[r] * kvHeads * hd, 0.0f);
  }
  const std::size_t stride = heads * hd, kvStride = kvHeads * hd;
  for (uint32_t r = 0; r < n; ++r) {
    for (const AttnRun& qr : runs[r]) {
      for (std::size_t i = qr.local; i < qr.local + qr.rows; ++i) {
        const std::size_t queryPos = qr.global + (i - qr.local);
        for (std::size_t h = 0; h < heads; ++h) {
          const float* qi = q[r].data() + i * stride + h * hd;
          const float* gi = dout[r].data() + i * stride + h * hd;
          const float delta = dot(gi, o[r].data() + i * stride + h * hd, hd);
          const float l = lse[r][h * seq[r] + i];
          const std::size_t kvCol = (h / group) * hd;
          float* dqi = dq[r].data() + i * stride + h * hd;
          for (uint32_t src = 0; src < n; ++src) {
            for (const AttnRun& kr : runs[src]) {
              std::size_t keys = kr.rows;
              if (causal) keys = queryPos < kr.global ? 0 : std::min(keys, queryPos - kr.global + 1);
              for (std::size_t j = kr.local; j < kr.local + keys; ++j) {
                const float* kj = k[src].data() + j * kvStride + kvCol;
                const float* vj = v[src].data() + j * kvStride + kvCol;
                const float p = std::exp(dot(qi, kj, hd) * scale - l);
                const float ds = p * (dot(gi, vj, hd) - delta) * scale;
                float* dkj = dk[src].data() + j * kvStride + kvCol;
                float* dvj = dv[src].data() + j * kvStride + kvCol;
                for (std::size_t c = 0; c < hd; ++c) {
                  dqi[c] += ds * kj[c];
                  dkj[c] += ds * qi[c];
                  dvj[c] += p * gi[c];
                }
              }
            }
          }
        }
      }
    }
  }
  // Written only after every rank's inputs were read.
  for (uint32_t r = 0; r < n; ++r) {
    store(ranks[r].data[slot::kDq], dtype, dq[r].data(), dq[r].size());
    store(ranks[r].data[slot::kDk], dtype, dk[r].data(), dk[r].size());
    store(ranks[r].data[slot::kDv], dtype, dv[r].data(), dv[r].size());
  }
}

// ---- allgather ------------------------------------------------------------------------------------------

void allGather(std::span<const RankOp> ranks) {
  const std::size_t bytes = ranks[0].desc.dims[dim::kBytes];
  requireMemory(ranks, slot::kSend);
  requireMemory(ranks, slot::kRecv);
  for (const RankOp& dst : ranks)
    for (std::size_t src = 0; src < ranks.size(); ++src)
      std::memcpy(dst.data[slot::kRecv] + src * bytes, ranks[src].data[slot::kSend], bytes);
}

void barrier(std::span<const RankOp>) {}

// The cpu backend's implementation of every op in the table, by kind (a test checks that none is missing).
using Implementation = void (*)(std::span<const RankOp>);
Implementation implementation(OpKind kind) {
  switch (kind) {
    case OpKind::kAgGemm: return agGemm;
    case OpKind::kGemmRs:
    case OpKind::kGemmAr: return gemmReduce;
    case OpKind::kMoeDispatchGemm: return moeDispatchGemm;
    case OpKind::kMoeDispatchFfnCombine: return moeDispatchFfnCombine;
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

bool cpuRuns(OpKind kind) { return implementation(kind) != nullptr; }

uint64_t cpuScratchBytes(std::span<const OpDescriptor> descs) {
  if (descs.empty()) return 0;
  const OpSpec& op = opSpec(descs[0].kind);
  // Every implementation works on fp32 copies of its tensors, and at most one more of the same size (partials,
  // activations); 2 x 4 bytes per element of every slot of every rank bounds that. Saturating: a sum past 2^64
  // is "too much" all the same.
  uint64_t elements = 0;
  for (const OpDescriptor& d : descs) {
    for (int s = 0; s < op.slotCount; ++s) {
      bool overflow = false;
      const uint64_t n = slotElements(op, s, d, &overflow);
      if (overflow || __builtin_add_overflow(elements, n, &elements)) return UINT64_MAX;
    }
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(elements, uint64_t{8}, &bytes)) return UINT64_MAX;
  if (descs[0].kind == OpKind::kRingAttention) {
    // The query block's accumulator and one row of scores over the longest chunk: per block, not per element,
    // so they are the only scratch that does not shrink with the tensors (head_dim 2^26 with seq 0).
    uint64_t longest = 0;
    for (const OpDescriptor& d : descs) longest = std::max(longest, d.dims[dim::kSeq]);
    bytes += (16 * descs[0].dims[dim::kHeadDim] + longest) * sizeof(float);
  }
  if (descs[0].kind == OpKind::kMoeFfnBackward) {
    // Beyond the slots: dx of every (token, slot), and the routed rows of x, dout and a, b gathered per expert.
    const uint64_t perRow = 3 * descs[0].dims[dim::kHidden] + 2 * descs[0].dims[dim::kFfn];
    for (const OpDescriptor& d : descs) {
      uint64_t extra = 0;
      if (__builtin_mul_overflow(d.dims[dim::kTokens] * d.dims[dim::kTopk], perRow * sizeof(float), &extra) ||
          __builtin_add_overflow(bytes, extra, &bytes)) {
        return UINT64_MAX;
      }
    }
  }
  return bytes;
}

void runCpuOp(std::span<const RankOp> ranks) {
  if (ranks.empty()) fail(ErrorCode::kInternal, "cpu backend: an op with no ranks");
  const auto fn = implementation(ranks[0].desc.kind);
  if (fn == nullptr) {
    fail(ErrorCode::kInternal, "cpu backend: op kind {} reached the executor unvalidated",
         static_cast<uint16_t>(ranks[0].desc.kind));
  }
  fn(ranks);
}

}  // namespace tandem::daemon
