// The attention backward core (kernels/attention_bwd.cu) on one GPU against an fp64 reference computed here from the
// same 16-bit inputs: bf16 and fp16, head_dim 64 and 128, causal and not, GQA groups 1 / 4 / 8, query and key lengths
// that differ and are no block multiple, query and key chunks at global positions (ring attention's chunk pairs: one
// wholly in the past, one wholly in the future, rows that see no key), a custom scale, both dq modes, key walks long
// enough to wrap the K / V rings of the wgmma dq kernel several times. Outputs are poisoned (NaN) before each launch.
// Every case runs on both cores (wgmma and mma.sync, AttentionBwdCore: dk / dv and both dq modes). Then:
// lse and o from the forward core, 20 bitwise repeats of the deterministic mode on each core, and the host-side shape
// rules.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "tandem/common/error.hpp"
#include "tandem/kernels/attention.hpp"
#include "tandem/kernels/attention_bwd.hpp"

namespace {

using tandem::ErrorCode;
using tandem::gputest::ck;
using tandem::gputest::DeviceMem;
using tandem::gputest::Stream;
using tandem::gputest::syncWithin;
using tandem::kernels::AttentionBwdCore;
using tandem::kernels::AttentionBwdDq;
using tandem::kernels::AttentionBwdParams;
using tandem::kernels::AttentionDtype;
using tandem::kernels::attentionBwdWorkspaceBytes;
using tandem::kernels::launchAttentionBwd;
using tandem::kernels::validateAttentionBwd;

uint16_t toBits(double f, AttentionDtype dt) {
  const float x = static_cast<float>(f);
  if (dt == AttentionDtype::kBf16) return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(x)).x;
  return static_cast<__half_raw>(__float2half_rn(x)).x;
}
double fromBits(uint16_t b, AttentionDtype dt) {
  if (dt == AttentionDtype::kBf16) {
    __nv_bfloat16_raw r;
    r.x = b;
    return __bfloat162float(__nv_bfloat16(r));
  }
  __half_raw r;
  r.x = b;
  return __half2float(__half(r));
}

struct Case {
  std::string name;
  AttentionDtype dtype = AttentionDtype::kBf16;
  int headDim = 128;
  int heads = 2;
  int kvHeads = 2;
  int64_t sq = 0, sk = 0;
  bool causal = false;
  int64_t qStart = 0, kStart = 0;
  float scale = 0.0f;
  AttentionBwdCore core = AttentionBwdCore::kWgmma;
};

constexpr AttentionBwdCore kCores[] = {AttentionBwdCore::kWgmma, AttentionBwdCore::kMmaSync};
const char* coreName(AttentionBwdCore c) { return c == AttentionBwdCore::kWgmma ? "wgmma" : "mma_sync"; }

double scaleOf(const Case& c) { return c.scale == 0.0f ? 1.0 / std::sqrt(static_cast<double>(c.headDim)) : c.scale; }

// Inputs as the GPU sees them (16-bit), the lse and o the kernel is given, and the fp64 reference gradients.
struct Problem {
  std::vector<uint16_t> q, k, v, o, dout;
  std::vector<float> lse;  // [heads, sq]
  std::vector<double> dq, dk, dv;
};

// Element (row, head, d) of a [rows, heads, hd] tensor.
size_t at(int64_t row, int head, int heads, int hd, int d) {
  return (static_cast<size_t>(row) * heads + head) * hd + d;
}

std::vector<double> widen(const std::vector<uint16_t>& bits, AttentionDtype dt) {
  std::vector<double> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = fromBits(bits[i], dt);
  return out;
}

// Random inputs; o and lse from an fp64 forward (o rounded to 16 bits, as the forward stores it).
Problem makeProblem(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uni(-1.0, 1.0);
  Problem pr;
  const size_t qn = static_cast<size_t>(c.sq) * c.heads * c.headDim, kn = static_cast<size_t>(c.sk) * c.kvHeads * c.headDim;
  for (auto* t : {&pr.q, &pr.dout}) {
    t->resize(qn);
    for (auto& x : *t) x = toBits(uni(rng), c.dtype);
  }
  for (auto* t : {&pr.k, &pr.v}) {
    t->resize(kn);
    for (auto& x : *t) x = toBits(uni(rng), c.dtype);
  }
  pr.o.assign(qn, 0);
  pr.lse.assign(static_cast<size_t>(c.heads) * c.sq, -std::numeric_limits<float>::infinity());
  const double scale = scaleOf(c);
  const int group = c.heads / c.kvHeads, hd = c.headDim;
  const std::vector<double> q = widen(pr.q, c.dtype), k = widen(pr.k, c.dtype), v = widen(pr.v, c.dtype);
  std::vector<double> s(static_cast<size_t>(c.sk)), acc(hd);
  for (int h = 0; h < c.heads; ++h) {
    const int hk = h / group;
    for (int64_t i = 0; i < c.sq; ++i) {
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < c.sk; ++j) {
        s[j] = -std::numeric_limits<double>::infinity();
        if (c.causal && c.kStart + j > c.qStart + i) continue;
        double dot = 0;
        for (int d = 0; d < hd; ++d) dot += q[at(i, h, c.heads, hd, d)] * k[at(j, hk, c.kvHeads, hd, d)];
        s[j] = dot * scale;
        m = std::max(m, s[j]);
      }
      if (m == -std::numeric_limits<double>::infinity()) continue;  // no visible key: o 0, lse -inf
      double l = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j < c.sk; ++j) {
        if (s[j] == -std::numeric_limits<double>::infinity()) continue;
        const double p = std::exp(s[j] - m);
        l += p;
        for (int d = 0; d < hd; ++d) acc[d] += p * v[at(j, hk, c.kvHeads, hd, d)];
      }
      for (int d = 0; d < hd; ++d) pr.o[at(i, h, c.heads, hd, d)] = toBits(acc[d] / l, c.dtype);
      pr.lse[h * c.sq + i] = static_cast<float>(m + std::log(l));
    }
  }
  return pr;
}

// fp64 gradients from the inputs, o and lse the kernel gets: P = exp(scale s - lse), D = rowsum(dout * o).
void referenceGradients(const Case& c, Problem& pr) {
  const double scale = scaleOf(c);
  const int group = c.heads / c.kvHeads, hd = c.headDim;
  pr.dq.assign(pr.q.size(), 0.0);
  pr.dk.assign(pr.k.size(), 0.0);
  pr.dv.assign(pr.v.size(), 0.0);
  const std::vector<double> k = widen(pr.k, c.dtype), v = widen(pr.v, c.dtype);
  std::vector<double> qi(hd), doi(hd);
  for (int h = 0; h < c.heads; ++h) {
    const int hk = h / group;
    for (int64_t i = 0; i < c.sq; ++i) {
      const double lse = pr.lse[h * c.sq + i];
      if (lse == -std::numeric_limits<double>::infinity()) continue;  // sees no key: no gradient
      double dsum = 0;
      for (int d = 0; d < hd; ++d) {
        qi[d] = fromBits(pr.q[at(i, h, c.heads, hd, d)], c.dtype);
        doi[d] = fromBits(pr.dout[at(i, h, c.heads, hd, d)], c.dtype);
        dsum += doi[d] * fromBits(pr.o[at(i, h, c.heads, hd, d)], c.dtype);
      }
      for (int64_t j = 0; j < c.sk; ++j) {
        if (c.causal && c.kStart + j > c.qStart + i) continue;
        double sdot = 0, dp = 0;
        for (int d = 0; d < hd; ++d) {
          sdot += qi[d] * k[at(j, hk, c.kvHeads, hd, d)];
          dp += doi[d] * v[at(j, hk, c.kvHeads, hd, d)];
        }
        const double p = std::exp(sdot * scale - lse);
        const double ds = p * (dp - dsum);
        for (int d = 0; d < hd; ++d) {
          pr.dq[at(i, h, c.heads, hd, d)] += scale * ds * k[at(j, hk, c.kvHeads, hd, d)];
          pr.dk[at(j, hk, c.kvHeads, hd, d)] += scale * ds * qi[d];
          pr.dv[at(j, hk, c.kvHeads, hd, d)] += p * doi[d];
        }
      }
    }
  }
}

template <class V>
void upload(const DeviceMem& m, const std::vector<V>& host) {
  ck(cudaMemcpy(m.p, host.data(), host.size() * sizeof(V), cudaMemcpyHostToDevice), "upload");
}

struct DeviceProblem {
  DeviceMem q, k, v, o, dout, lse, dq, dk, dv, ws;
  AttentionBwdParams params{};
  DeviceProblem(const Case& c, const Problem& pr, AttentionBwdDq mode)
      : q(pr.q.size() * 2), k(pr.k.size() * 2), v(pr.v.size() * 2), o(pr.o.size() * 2), dout(pr.dout.size() * 2),
        lse(pr.lse.size() * 4), dq(pr.q.size() * 2), dk(pr.k.size() * 2), dv(pr.v.size() * 2), ws(wsBytes(c, mode)) {
    upload(q, pr.q);
    upload(k, pr.k);
    upload(v, pr.v);
    upload(o, pr.o);
    upload(dout, pr.dout);
    upload(lse, pr.lse);
    params = paramsOf(c, mode);
    params.q = q.p;
    params.k = k.p;
    params.v = v.p;
    params.o = o.p;
    params.dout = dout.p;
    params.lse = lse.as<float>();
    params.dq = dq.p;
    params.dk = dk.p;
    params.dv = dv.p;
    params.workspace = ws.p;
    params.workspaceBytes = wsBytes(c, mode);
  }
  static AttentionBwdParams paramsOf(const Case& c, AttentionBwdDq mode) {
    AttentionBwdParams p{};
    p.sq = c.sq;
    p.sk = c.sk;
    p.heads = c.heads;
    p.kvHeads = c.kvHeads;
    p.headDim = c.headDim;
    p.dtype = c.dtype;
    p.causal = c.causal;
    p.dqMode = mode;
    p.scale = c.scale;
    p.qStart = c.qStart;
    p.kStart = c.kStart;
    p.core = c.core;
    return p;
  }
  static size_t wsBytes(const Case& c, AttentionBwdDq mode) { return attentionBwdWorkspaceBytes(paramsOf(c, mode)); }

  // Poisons the outputs (0xFF bytes: NaN in bf16 and fp16), runs the backward, waits.
  void run(const Case& c, cudaStream_t s) {
    ck(cudaMemsetAsync(dq.p, 0xFF, static_cast<size_t>(c.sq) * c.heads * c.headDim * 2, s), "poison dq");
    ck(cudaMemsetAsync(dk.p, 0xFF, static_cast<size_t>(c.sk) * c.kvHeads * c.headDim * 2, s), "poison dk");
    ck(cudaMemsetAsync(dv.p, 0xFF, static_cast<size_t>(c.sk) * c.kvHeads * c.headDim * 2, s), "poison dv");
    launchAttentionBwd(params, s);
    syncWithin(s, 60.0, "attention backward " + c.name);
  }
  std::vector<uint16_t> download(const DeviceMem& m, size_t n) const {
    std::vector<uint16_t> h(n);
    ck(cudaMemcpy(h.data(), m.p, n * 2, cudaMemcpyDeviceToHost), "download");
    return h;
  }
};

// ||out - ref|| / ||ref|| (every element finite), or ||out|| where the reference is all zeros.
double relError(const std::vector<uint16_t>& out, const std::vector<double>& ref, AttentionDtype dt, size_t& bad) {
  double num = 0, den = 0;
  bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double o = fromBits(out[i], dt);
    if (!std::isfinite(o)) {
      ++bad;
      continue;
    }
    num += (o - ref[i]) * (o - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// bf16 keeps 8 significant bits, fp16 11: P and dS are rounded to them before their products, and every output once.
double tolerance(AttentionDtype dt) { return dt == AttentionDtype::kBf16 ? 2e-2 : 5e-3; }

void checkAgainstReference(const Case& c, const Problem& pr, DeviceProblem& dev) {
  const struct {
    const char* name;
    const DeviceMem& m;
    const std::vector<double>& ref;
  } outs[] = {{"dq", dev.dq, pr.dq}, {"dk", dev.dk, pr.dk}, {"dv", dev.dv, pr.dv}};
  for (const auto& t : outs) {
    size_t bad = 0;
    const double err = relError(dev.download(t.m, t.ref.size()), t.ref, c.dtype, bad);
    INFO(c.name << " " << t.name << ": relative error " << err << ", non-finite " << bad);
    CHECK(bad == 0);
    CHECK(err < tolerance(c.dtype));
  }
}

std::vector<Case> cases() {
  using D = AttentionDtype;
  return {
      {"bf16 hd128 full mha 256x256", D::kBf16, 128, 2, 2, 256, 256, false, 0, 0, 0.0f},
      {"bf16 hd128 causal gqa4 333x333", D::kBf16, 128, 4, 1, 333, 333, true, 0, 0, 0.0f},
      {"fp16 hd64 causal gqa8 bottom-right 200x455", D::kFp16, 64, 8, 1, 200, 455, true, 255, 0, 0.0f},
      {"bf16 hd64 full odd 77x190 scale 0.05", D::kBf16, 64, 3, 3, 77, 190, false, 0, 0, 0.05f},
      {"fp16 hd128 full gqa4 130x70", D::kFp16, 128, 8, 2, 130, 70, false, 0, 0, 0.0f},
      {"fp16 hd128 causal gqa4 rows without keys", D::kFp16, 128, 4, 1, 300, 200, true, 0, 100, 0.0f},
      {"bf16 hd128 causal gqa4 chunk in the past", D::kBf16, 128, 8, 2, 128, 192, true, 512, 0, 0.0f},
      {"bf16 hd64 causal chunk in the future", D::kBf16, 64, 2, 2, 100, 150, true, 0, 1000, 0.0f},
      {"bf16 hd64 causal gqa8 offsets 257x300", D::kBf16, 64, 8, 1, 257, 300, true, 1000, 980, 0.0f},
      {"fp16 hd64 causal mha 129x129", D::kFp16, 64, 2, 2, 129, 129, true, 0, 0, 0.0f},
      {"bf16 hd64 full gqa2 long keys 70x1030", D::kBf16, 64, 4, 2, 70, 1030, false, 0, 0, 0.0f},
      {"fp16 hd128 causal gqa2 long keys 300x1000", D::kFp16, 128, 4, 2, 300, 1000, true, 700, 0, 0.0f},
  };
}

}  // namespace

TEST_CASE("attention backward matches an fp64 reference") {
  Stream stream;
  uint64_t seed = 1;
  for (const Case& c : cases()) {
    Problem pr = makeProblem(c, seed++);
    referenceGradients(c, pr);
    for (const AttentionBwdCore core : kCores) {
      for (const AttentionBwdDq mode : {AttentionBwdDq::kDeterministic, AttentionBwdDq::kAtomic}) {
        Case named = c;
        named.name = c.name + " " + coreName(core) + (mode == AttentionBwdDq::kAtomic ? " atomic" : " deterministic");
        named.core = core;
        DeviceProblem dev(named, pr, mode);
        dev.run(named, stream.s);
        checkAgainstReference(named, pr, dev);
      }
    }
  }
}

TEST_CASE("attention backward takes lse and o from the forward core") {
  Stream stream;
  for (const bool causal : {false, true}) {
    const Case c{causal ? "forward-fed causal" : "forward-fed full", AttentionDtype::kBf16, 128, 4, 4, 384, 384,
                 causal, 0, 0, 0.0f, AttentionBwdCore::kWgmma};
    Problem pr = makeProblem(c, 77);
    DeviceProblem dev(c, pr, AttentionBwdDq::kDeterministic);
    // Overwrite o and lse with the forward core's.
    tandem::kernels::AttentionParams f{};
    f.q = dev.q.p;
    f.out = dev.o.p;
    f.lse = dev.lse.as<float>();
    f.sq = c.sq;
    f.heads = c.heads;
    f.headDim = c.headDim;
    f.numKv = 1;
    f.kv[0].k = dev.k.p;
    f.kv[0].v = dev.v.p;
    f.kv[0].length = c.sk;
    f.dtype = c.dtype;
    f.causal = c.causal;
    tandem::kernels::launchAttention(f, stream.s);
    syncWithin(stream.s, 60.0, "attention forward");
    pr.o = dev.download(dev.o, pr.o.size());
    ck(cudaMemcpy(pr.lse.data(), dev.lse.p, pr.lse.size() * 4, cudaMemcpyDeviceToHost), "download lse");
    referenceGradients(c, pr);
    dev.run(c, stream.s);
    checkAgainstReference(c, pr, dev);
  }
}

TEST_CASE("attention backward's deterministic mode repeats bitwise") {
  Stream stream;
  for (const int hd : {128, 64}) {
    Case c{"repeat causal gqa8 hd" + std::to_string(hd), AttentionDtype::kBf16, hd, 8, 1, 520, 700, true, 180, 0, 0.0f};
    Problem pr = makeProblem(c, 99);
    referenceGradients(c, pr);
    for (const AttentionBwdCore core : kCores) {
      c.core = core;
      DeviceProblem dev(c, pr, AttentionBwdDq::kDeterministic);
      dev.run(c, stream.s);
      INFO(c.name << " " << coreName(core));
      checkAgainstReference(c, pr, dev);
      const auto dq0 = dev.download(dev.dq, pr.dq.size()), dk0 = dev.download(dev.dk, pr.dk.size()),
                 dv0 = dev.download(dev.dv, pr.dv.size());
      for (int r = 1; r < 20; ++r) {
        dev.run(c, stream.s);
        INFO("repeat " << r);
        CHECK(dev.download(dev.dq, pr.dq.size()) == dq0);
        CHECK(dev.download(dev.dk, pr.dk.size()) == dk0);
        CHECK(dev.download(dev.dv, pr.dv.size()) == dv0);
      }
    }
  }
}

TEST_CASE("attention backward's two cores agree") {
  // Larger than the reference cases (several KV blocks and query steps per head, the ring of Q / dO stages wrapping
  // many times): the wgmma core against the mma.sync core, both dq modes.
  Stream stream;
  for (const int hd : {128, 64}) {
    for (const bool causal : {false, true}) {
      Case c{"cores agree", AttentionDtype::kBf16, hd, 8, 2, 1000, 1100, causal, 100, 0, 0.0f};
      Problem pr = makeProblem(c, 7);
      for (const AttentionBwdDq mode : {AttentionBwdDq::kDeterministic, AttentionBwdDq::kAtomic}) {
        std::vector<uint16_t> out[2][3];
        for (int k = 0; k < 2; ++k) {
          c.core = kCores[k];
          DeviceProblem dev(c, pr, mode);
          dev.run(c, stream.s);
          out[k][0] = dev.download(dev.dq, pr.q.size());
          out[k][1] = dev.download(dev.dk, pr.k.size());
          out[k][2] = dev.download(dev.dv, pr.v.size());
        }
        for (int i = 0; i < 3; ++i) {
          const std::vector<double> ref = widen(out[1][i], c.dtype);
          size_t bad = 0;
          const double err = relError(out[0][i], ref, c.dtype, bad);
          INFO("hd " << hd << " causal " << causal << " mode " << static_cast<int>(mode) << " output " << i
                     << ": wgmma vs mma_sync relative error " << err << ", non-finite " << bad);
          CHECK(bad == 0);
          CHECK(err < 1e-2);
        }
      }
    }
  }
}

TEST_CASE("attention backward refuses broken shapes naming the rule") {
  const Case c{"rules", AttentionDtype::kBf16, 128, 8, 2, 64, 64, false, 0, 0, 0.0f};
  AttentionBwdParams p = DeviceProblem::paramsOf(c, AttentionBwdDq::kDeterministic);
  alignas(16) static uint8_t dummy[16];
  p.q = p.k = p.v = p.o = p.dout = dummy;
  p.lse = reinterpret_cast<const float*>(dummy);
  const auto expectRule = [](const AttentionBwdParams& bad, const char* rule) {
    try {
      validateAttentionBwd(bad);
      FAIL("accepted; expected rule " << rule);
    } catch (const tandem::Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      CHECK(std::string(e.what()).find(rule) != std::string::npos);
    }
  };
  AttentionBwdParams bad = p;
  bad.kvHeads = 3;
  expectRule(bad, "rule kv_heads");
  bad = p;
  bad.headDim = 96;
  expectRule(bad, "rule head_dim");
  bad = p;
  bad.dq = bad.dk = bad.dv = nullptr;
  expectRule(bad, "rule pointers");
  bad = p;
  bad.dq = bad.dk = bad.dv = dummy;  // no workspace
  expectRule(bad, "rule workspace");
  bad = p;
  bad.scale = -1.0f;
  expectRule(bad, "rule scale");
  bad = p;
  bad.core = static_cast<AttentionBwdCore>(7);
  expectRule(bad, "rule core");
}
