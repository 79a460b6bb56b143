// The op table: everything tandem knows about an op apart from its implementations. Each entry names the op, its
// dims, its tensor slots and their extents as functions of the dims, which dims are per rank, its dtype rules and
// what it sends between nodes, its C argument struct field by field, and what its kernels need from the executors.
// Descriptor naming, validation (validate.hpp), `tandemctl run`, the reference's dispatch, every "this backend does
// not run X" message, the Python bindings (through tandem_op_table(), opTableJson) and the cross-node payload rule
// (crossPayload) are derived from it. Backends say which ops they run as an OpSet; the daemon refuses the rest when a
// descriptor is admitted.
#pragma once

#include <array>
#include <bitset>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

#include "tandem/common/descriptor.hpp"

namespace tandem {

// error.hpp's; declared here only, so that this header (which nvcc reads through plan_key.hpp) does not pull in fmt.
enum class ErrorCode : int32_t;

// What a slot's elements are.
enum class ElementType : uint8_t {
  kOpDtype,  // the descriptor's dtype (bf16, fp16 or fp32)
  kI32,      // int32 whatever the op's dtype (expert ids, row info)
  kF32,      // fp32 whatever the op's dtype (routing weights, FP8 scales)
  kRaw,      // untyped bytes (allgather): element size 1, no alignment
  kOutDtype,  // the GEMM ops' c: the dtype in the flags' kFlagGemmOutDtype, else the descriptor's (gemmOutDtype)
  kWeightDtype,  // the MoE ops' expert weights (w, w1, w2): the dtype in the flags' kFlagMoeWeightDtype, else the descriptor's
};

// One factor of a slot's extent, as a function of the descriptor.
struct ExtentTerm {
  enum class Kind : uint8_t {
    kDim,        // dims[dim]
    kShard,      // rowsOf(dims[dim], rank, nranks): this rank's share of a sharded dim
    kPerRank,    // dims[dim] / nranks: this rank's share of a dim spread evenly (MoE experts)
    kNranks,     // nranks
    kConst,      // value
    kBlocks,     // ceil(dims[dim] / value): blocks of `value` (FP8 block scales)
  };
  Kind kind = Kind::kConst;
  uint8_t dim = 0;
  uint32_t value = 1;
};

// One tensor of an op.
struct SlotSpec {
  std::string_view name;       // as tandem.h names the field ("a", "topk_ids", ...)
  ElementType type = ElementType::kOpDtype;
  std::array<ExtentTerm, 4> terms{};  // elements = product of the first termCount terms
  uint8_t termCount = 0;
  std::string_view shape;      // as tandem.h writes it, for error messages ("[rows_of(m, rank, nranks), k]")
  bool output = false;         // written by the op
  bool optional = false;       // bufferId 0 allowed: the op then skips that output
  // How the terms group into a tensor's axes, as Python shapes it: axes[i] terms make axis i (w1's
  // [experts/nranks, 2*ffn, hidden] is {1, 2, 1}). All zero: one axis per term.
  std::array<uint8_t, 4> axes{};
  // A GEMM operand whose storage the op's layout flag (kFlagGemmLayout) may transpose: kA is stored [k, m] in kTN,
  // kB [k, n] in kNN and kTN. Such a slot has two axes (two term groups), which the transposed storage swaps;
  // shapeTransposed is its shape text then.
  enum class Operand : uint8_t { kNone, kA, kB };
  Operand operand = Operand::kNone;
  std::string_view shapeTransposed;
  // An FP8 scale (a_scale, b_scale, w1_scale, w2_scale): its terms hold only where the scales are blocks
  // (fp8ScaleShape); per-tensor scaling takes one element, and an op without FP8 inputs none (extent 0).
  bool fp8Scale = false;
};

// How the FP8 scale slots of a descriptor are shaped: none (no FP8 input), one element each (per tensor: the GEMM ops
// without kFlagFp8BlockScale) or the slots' terms (blocks: the GEMM ops' kFlagFp8BlockScale, the MoE ops' FP8
// weights).
enum class Fp8ScaleShape : uint8_t { kNone, kTensor, kBlock };

struct OpSpec;
// The shape of `d`'s FP8 scale slots.
Fp8ScaleShape fp8ScaleShape(const OpSpec& spec, const OpDescriptor& d);

// Whether slot `s` is stored transposed under `flags` (SlotSpec::operand).
bool slotTransposed(const SlotSpec& s, uint16_t flags);
// The element type of slot `s` in descriptor `d` (kInvalid for raw bytes), and its size (1 for raw bytes).
DType slotDtype(const SlotSpec& s, const OpDescriptor& d);
std::size_t slotElementSize(const SlotSpec& s, const OpDescriptor& d);

// How `tandemctl run` (and the tests' shape helper) turn a user's global size into each rank's dim.
enum class DimSplit : uint8_t {
  kGlobal,    // every rank passes the same value
  kSplit,     // each rank passes rowsOf(total, rank, nranks) (gemm-rs k, attention seq)
  kPerRank,   // each rank passes the value as given (MoE tokens per rank)
  kCapacity,  // MoE receive capacity: the worst case nranks * tokens * topk, at least 1
};

struct DimSpec {
  std::string_view name;     // "m", "tokens", ... as in tandem.h
  std::string_view cli;      // the `tandemctl run` option that supplies it ("m" for --m), empty: derived
  DimSplit split = DimSplit::kGlobal;
  bool mayBeZero = false;    // a per-rank row count: a rank may own no rows
  int8_t zeroMeans = -1;     // >= 0: a C caller's 0 (or a field its struct_size ends before) means dims[zeroMeans]
  bool perRank() const { return split != DimSplit::kGlobal; }  // may differ between ranks
};

// What an op moves between nodes; the cpu backend's cross-node path (and the staging size check) follow it.
enum class CrossNode : uint8_t {
  kNone,           // nothing (barrier): one empty exchange orders the nodes
  kGather,         // every node sends its ranks' `crossSlot` to every other node (ag-gemm's A, allgather's send)
  kReduceScatter,  // every node sends each other node fp32 partial sums of that node's ranks' `crossSlot`
  kAllReduce,      // every node sends every other node its fp32 partial sum of `crossSlot`
  kReplicate,      // every node sends its ranks' inputs to every other node, which run the op whole (reference path)
};

// One field of the op's C argument struct (tandem.h), after its leading `size_t struct_size`, in declaration order.
struct CField {
  enum class Kind : uint8_t {
    kDtype,   // tandem_dtype_t: the descriptor's dtype
    kDim,     // uint64_t: dims[index]
    kFlag,    // int (or an int-sized enum): the value goes into flag bits [index, index + bits); a boolean int
              // (bits 1) sets the bit when nonzero, an enum must be <= maxValue
    kScale,   // float: OpDescriptor::scale
    kTensor,  // tandem_tensor_t: slots[index]
    kStream,  // void* cuda_stream
  };
  Kind kind = Kind::kDim;
  uint8_t index = 0;
  std::string_view name;  // as tandem.h names the field
  bool isEnum = false;    // kFlag: an enum of named values (tandem_attention_layout_t), not a boolean int
  uint8_t bits = 1;       // kFlag: how many flag bits the value takes
  uint8_t maxValue = 1;   // kFlag enum: the largest valid value
  std::string_view values;  // kFlag enum: its valid values, for messages ("TANDEM_GEMM_NT (0), ...")
};

// Where each field of an op's C argument struct lies on LP64 (x86-64, aarch64), by C's alignment rules.
struct CArgsLayout {
  std::array<uint16_t, 24> offsets{};  // of cFields[i]; struct_size is at 0
  uint16_t size = 0;                   // sizeof the struct
};

struct OpSpec {
  OpKind kind = OpKind::kInvalid;
  std::string_view name;        // "ag-gemm": descriptors, messages, `tandemctl run OP`
  std::string_view cFunction;   // its entry point in tandem.h
  std::string_view cStruct;     // its argument struct in tandem.h
  std::string_view cArgsFunction;  // the entry point that takes cStruct: cFunction, but tandem_barrier_stream
  std::string_view pyName;      // its method in the Python package ("moe_ffn")
  std::string_view summary;     // one line for --help
  std::array<DimSpec, kMaxOpDims> dims{};
  uint8_t dimCount = 0;
  std::array<SlotSpec, kMaxOpBuffers> slots{};
  uint8_t slotCount = 0;
  bool typed = true;            // false: carries no typed data, so any known dtype value (0 included) is accepted
  bool fp8 = false;             // takes FP8 inputs (dtype kF8E4M3/kF8E5M2) with a_scale and b_scale slots
  bool fp8Weights = false;      // its weights may be e4m3 (w_dtype, kFlagMoeWeightDtype) with block-scale slots, its
                                // other tensors in dtype (the MoE FFN and dispatch+GEMM)
  uint16_t flags = 0;           // the kFlag* bits it takes
  bool scale = false;           // uses OpDescriptor::scale
  CrossNode crossNode = CrossNode::kNone;
  int8_t crossSlot = -1;
  // Rules across dims that the table cannot say (MoE: experts % nranks, topk <= experts). Throws
  // Error(kInvalidArgument). Null: none.
  void (*checkDims)(const OpDescriptor&) = nullptr;
  // Rules across slots and dims that the table cannot say, checked once the BufferRefs are filled (the MoE FFN ops:
  // saved is given exactly when saved_rows > 0). Throws Error(kInvalidArgument). Null: none.
  void (*checkSlots)(const OpDescriptor&) = nullptr;
  std::array<CField, 24> cFields{};
  uint8_t cFieldCount = 0;
  // On the cuda backend's client executor: its kernels read tandemd's verdict themselves (a rejected op does nothing
  // on the device), so the stream need not wait for go and a rejected op needs no abort. False: once go opens, the
  // kernels run, so a rejected op aborts the communicator (client_gate.cpp).
  bool readsVerdict = false;
  // What its kernels can report on the device beyond a CUDA error: a wait past its deadline (a peer's flag never
  // came: kTimeout, or kPeerLost once the peer is known gone). ErrorCode{} (kOk): none (no kernel waits on a peer).
  ErrorCode deviceError{};
  // Non-empty: the cuda backend does not run this op yet, and why (what its GPU implementation still needs). The
  // cuda backend's refusal quotes it, and the CUDA builds' "every op" test accepts a missing gpu_ops.cpp entry only
  // for such an op. Empty: the cuda backend must run it.
  std::string_view cudaPending;
  // Non-empty: why it cannot be captured into a CUDA graph on a multi-rank communicator of the cuda backend's client
  // executor, although that executor runs it eagerly (captureRefusal quotes it). Empty: see graphReplayableOps.
};

// Every op, in OpKind order (kAgGemm first). ops()[i].kind == OpKind(i + 1).
std::span<const OpSpec> ops();
// The entry of a known kind; throws Error(kInvalidArgument) for kInvalid or an unknown value.
const OpSpec& opSpec(OpKind kind);
// The entry named `name` ("barrier" is also accepted for nop), or null.
const OpSpec* findOp(std::string_view name);
bool knownOp(OpKind kind);
// Elements of slot `s` of `d` (the slot's terms evaluated), with overflow reported through `overflow`.
uint64_t slotElements(const OpSpec& spec, int s, const OpDescriptor& d, bool* overflow);
// Bytes of slot `s` of `d`: its elements times their size (no overflow check: for descriptors already validated).
uint64_t slotBytes(const OpSpec& spec, int s, const OpDescriptor& d);
// Without the descriptor's flags: kOutDtype counts as the op dtype; slotElementSize is exact.
std::size_t elementSize(ElementType type, DType dtype);
// Each field's offset in the op's C argument struct, and its size.
CArgsLayout cArgsLayout(const OpSpec& spec);
// The bytes one C argument field of this kind takes in its struct (cArgsLayout's sizes).
std::size_t cFieldBytes(CField::Kind kind);
// Every op of the table as JSON, for bindings that build themselves from it (Python): names, dims, slots with their
// extents and axes, flags, the C struct's fields with their offsets, the cross-node rule. tandem_op_table() returns it.
std::string opTableJson();

// The bytes node `from` sends node `to` for one op across nodes, by the op's CrossNode rule: ranks[r] is rank r's
// descriptor and nodeOf[r] its node. The same on every node, so all nodes agree whether an op fits the staging
// before any of them starts; the cpu backend's cross-node path, the cuda backend's host staging and the GPU exchange
// plan all take it from here.
uint64_t crossNodeBytes(std::span<const OpDescriptor* const> ranks, std::span<const uint32_t> nodeOf, uint32_t from,
                        uint32_t to);

// A set of op kinds (a backend's or an executor's capabilities).
class OpSet {
 public:
  OpSet() = default;
  OpSet(std::initializer_list<OpKind> kinds) {
    for (OpKind k : kinds) add(k);
  }
  static OpSet all();  // every kind in the op table
  OpSet& add(OpKind k) {
    bits_.set(static_cast<std::size_t>(k));
    return *this;
  }
  bool contains(OpKind k) const {
    const auto i = static_cast<std::size_t>(k);
    return i < kOpKindCount && bits_.test(i);
  }
  bool operator==(const OpSet&) const = default;

 private:
  std::bitset<kOpKindCount> bits_;
};

// "the cuda backend (executor client) does not run moe-dispatch-gemm; it runs ag-gemm, ...; the cpu backend runs
// every op (daemon.backend: cpu)". Lists exactly the ops `runs` has and names the fix.
std::string unsupportedOpMessage(std::string_view backend, const OpSet& runs, OpKind kind);

}  // namespace tandem
