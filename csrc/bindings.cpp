// pybind11 bindings: the only file that defines the Python module.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include "backend.h"
#include "comm.h"
#include "comm_context.h"
#include "cpu_optim.h"
#include "dtypes.h"
#include "freed_storage.h"
#include "gather_bytes.h"
#include "host_memory.h"
#include "host_tasks.h"
#include "layout.h"
#include "pack.h"
#include "param_spec.h"
#include "param_slots.h"
#include "post_backward.h"
#include "row_exchange.h"
#include "strategy.h"
#include "unit.h"

namespace py = pybind11;
using namespace mfsdp;

namespace {

bool compiled_with_cuda() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

// Destroys an object that may hold the last reference to a c10d ProcessGroup (or to
// in-flight Work) without the GIL. A Gloo worker thread that is still freeing a finished
// collective's tensors needs the GIL to drop their Python objects, while the group's
// destructor waits for that thread: destroying it with the GIL held can deadlock.
template <typename T>
struct DeleteWithoutGil {
  void operator()(T* ptr) const {
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      delete ptr;
    } else {
      delete ptr;
    }
  }
};

template <typename T, typename... Args>
std::shared_ptr<T> make_shared_without_gil_delete(Args&&... args) {
  return std::shared_ptr<T>(new T(std::forward<Args>(args)...), DeleteWithoutGil<T>{});
}

// Sets the Python type of each sharded parameter's .grad from from_types[i] (exactly) to
// to_types[i] (None in either: leave it). The types are torch.Tensor and its subclasses
// without slots of their own (the same object layout). The Python object stays with the
// tensor while the parameter holds the gradient, so a type is set once per gradient, not
// per read.
void retype_grads(const Unit& unit, const std::vector<py::object>& from_types,
                  const std::vector<py::object>& to_types) {
  const auto& params = unit.sharded_params();
  MFSDP_CHECK_VALUE(from_types.size() == params.size() && to_types.size() == params.size(), "retype_grads: ",
                    from_types.size(), " and ", to_types.size(), " types for ", params.size(), " parameters");
  for (size_t i = 0; i < params.size(); ++i) {
    if (from_types[i].is_none() || to_types[i].is_none()) continue;
    const at::Tensor& grad = params[i].grad();
    if (!grad.defined()) continue;
    py::object obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(grad));
    if (!obj) throw py::error_already_set();
    auto* from = reinterpret_cast<PyTypeObject*>(from_types[i].ptr());
    if (Py_TYPE(obj.ptr()) != from) continue;
    auto* to = reinterpret_cast<PyTypeObject*>(to_types[i].ptr());
    Py_INCREF(to);  // instances of heap types own a reference to their type
    Py_SET_TYPE(obj.ptr(), to);
    Py_DECREF(from);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_fsdp_ext C++ core: flat layouts, packing kernels, collectives, units";
  m.def("compiled_with_cuda", &compiled_with_cuda);
  m.def("can_pin_host_memory", &can_pin_host_memory);
  m.def("empty_host", &empty_host, py::arg("numel"), py::arg("dtype"), py::arg("pin"),
        "A 1-D host tensor, its pages registered with CUDA when `pin` (exactly the bytes asked for).");

  py::class_<AdamHyper>(m, "AdamHyper")
      .def(py::init([](double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                       bool maximize) {
             return AdamHyper{lr, beta1, beta2, eps, weight_decay, decoupled, maximize};
           }),
           py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
           py::arg("decoupled_weight_decay"), py::arg("maximize"));
  py::class_<SgdHyper>(m, "SgdHyper")
      .def(py::init([](double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                       bool maximize) { return SgdHyper{lr, momentum, dampening, weight_decay, nesterov, maximize}; }),
           py::arg("lr"), py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"),
           py::arg("maximize"));
  // Copy-outs arrive as None where a tensor has none.
  auto defined_or_empty = [](const std::vector<std::optional<at::Tensor>>& outs) {
    std::vector<at::Tensor> v;
    bool any = false;
    for (const auto& t : outs) {
      v.push_back(t.value_or(at::Tensor()));
      any = any || t.has_value();
    }
    return any ? v : std::vector<at::Tensor>{};
  };
  m.def(
      "adam_step",
      [defined_or_empty](const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                         const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                         const std::vector<std::optional<at::Tensor>>& copy_outs, const std::vector<int64_t>& steps,
                         const AdamHyper& hyper, double grad_scale) {
        adam_step(params, grads, exp_avgs, exp_avg_sqs, defined_or_empty(copy_outs), steps, hyper, grad_scale);
      },
      py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("copy_outs"), py::arg("steps"), py::arg("hyper"), py::arg("grad_scale") = 1.0,
        "One Adam(W) step over host float32 tensors, multithreaded and vectorized (cpu_optim.h).",
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "sgd_step",
      [defined_or_empty](const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                         const std::vector<at::Tensor>& momentum_buffers,
                         const std::vector<std::optional<at::Tensor>>& copy_outs, const std::vector<bool>& first,
                         const SgdHyper& hyper, double grad_scale) {
        sgd_step(params, grads, momentum_buffers, defined_or_empty(copy_outs), first, hyper, grad_scale);
      },
      py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"),
        py::arg("copy_outs"), py::arg("first"), py::arg("hyper"), py::arg("grad_scale") = 1.0,
        "One SGD step over host float32 tensors (cpu_optim.h).", py::call_guard<py::gil_scoped_release>());
  py::class_<HostTask, std::shared_ptr<HostTask>>(m, "HostTask")
      .def("wait", &HostTask::wait, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("done", &HostTask::done)
      .def_property_readonly("what", &HostTask::what);
  // One segment: (params, grads, exp_avgs, exp_avg_sqs, copy_outs, steps, hyper).
  using AdamSegment = std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                                 std::vector<at::Tensor>, std::vector<std::optional<at::Tensor>>,
                                 std::vector<int64_t>, AdamHyper>;
  py::class_<HostTaskQueue, std::shared_ptr<HostTaskQueue>>(m, "HostTaskQueue")
      .def(py::init([] { return make_shared_without_gil_delete<HostTaskQueue>(); }))
      .def(
          "submit_adam_steps",
          [defined_or_empty](HostTaskQueue& queue, const std::vector<AdamSegment>& segments, double grad_scale,
                             std::string what) {
            // Aliases without Python objects: the worker thread drops them without the GIL.
            auto bare = [](const std::vector<at::Tensor>& ts) {
              std::vector<at::Tensor> out;
              out.reserve(ts.size());
              for (const auto& t : ts) out.push_back(t.alias());
              return out;
            };
            std::vector<AdamSegment> held;
            held.reserve(segments.size());
            for (const auto& [p, g, m1, m2, outs, steps, hyper] : segments) {
              std::vector<std::optional<at::Tensor>> bare_outs;
              for (const auto& o : outs) bare_outs.push_back(o ? std::optional<at::Tensor>(o->alias()) : std::nullopt);
              held.emplace_back(bare(p), bare(g), bare(m1), bare(m2), std::move(bare_outs), steps, hyper);
            }
            return queue.submit(
                [held = std::move(held), grad_scale, defined_or_empty]() {
                  for (const auto& [p, g, m1, m2, outs, steps, hyper] : held) {
                    adam_step(p, g, m1, m2, defined_or_empty(outs), steps, hyper, grad_scale);
                  }
                },
                std::move(what));
          },
          py::arg("segments"), py::arg("grad_scale"), py::arg("what"),
          "Run Adam(W) steps over the segments on the queue's thread; returns the HostTask.");
  m.def("set_host_task_delay_ms", &set_host_task_delay_ms, py::arg("ms"),
        "Tests: every host task starts this late (a reader that does not wait sees old values).");
  m.def("cpu_optim_threads", &cpu_optim_threads);
  m.def("set_cpu_optim_threads", &set_cpu_optim_threads, py::arg("threads"));
  m.def("freed_storage_guard", &freed_storage_guard,
        "Whether reading a freed unsharded parameter raises (needs a torch whose StorageImpl can refuse and "
        "re-allow data access); without it such a read touches freed memory.");

  py::class_<ShardSlice>(m, "ShardSlice")
      .def_readonly("param_offset", &ShardSlice::param_offset)
      .def_readonly("shard_offset", &ShardSlice::shard_offset)
      .def_readonly("numel", &ShardSlice::numel)
      .def("__repr__", [](const ShardSlice& s) {
        return "ShardSlice(param_offset=" + std::to_string(s.param_offset) +
               ", shard_offset=" + std::to_string(s.shard_offset) +
               ", numel=" + std::to_string(s.numel) + ")";
      });

  py::class_<FlatLayout>(m, "FlatLayout")
      .def_static("even", &FlatLayout::even, py::arg("numels"), py::arg("world_size"),
                  py::arg("alignment") = kDefaultAlignment)
      .def_static("by_owner", &FlatLayout::by_owner, py::arg("numels"), py::arg("owners"),
                  py::arg("world_size"), py::arg("alignment") = kDefaultAlignment)
      .def_property_readonly("kind", [](const FlatLayout& l) {
        return l.kind() == SegmentKind::kEven ? "even" : "owner";
      })
      .def_property_readonly("world_size", &FlatLayout::world_size)
      .def_property_readonly("alignment", &FlatLayout::alignment)
      .def_property_readonly("num_params", &FlatLayout::num_params)
      .def_property_readonly("total_numel", &FlatLayout::total_numel)
      .def_property_readonly("offsets", &FlatLayout::offsets)
      .def_property_readonly("numels", &FlatLayout::numels)
      .def_property_readonly("segment_starts", &FlatLayout::segment_starts)
      .def_property_readonly("segment_numels", &FlatLayout::segment_numels)
      .def_property_readonly("max_segment_numel", &FlatLayout::max_segment_numel)
      .def_property_readonly("has_gaps", &FlatLayout::has_gaps)
      .def_property_readonly("padding_fraction", &FlatLayout::padding_fraction)
      .def("owner", &FlatLayout::owner)
      .def("shard_slice", &FlatLayout::shard_slice, py::arg("param"), py::arg("rank"))
      .def("shard_slices", &FlatLayout::shard_slices, py::arg("rank"))
      .def("__repr__", &FlatLayout::describe);

  py::class_<ExchangePiece>(m, "ExchangePiece")
      .def_readonly("peer", &ExchangePiece::peer)
      .def_readonly("param", &ExchangePiece::param)
      .def_readonly("src_offset", &ExchangePiece::src_offset)
      .def_readonly("dst_offset", &ExchangePiece::dst_offset)
      .def_readonly("numel", &ExchangePiece::numel);
  py::class_<RowExchangePlan>(m, "RowExchangePlan")
      .def_readonly("send", &RowExchangePlan::send)
      .def_readonly("recv", &RowExchangePlan::recv)
      .def_readonly("send_splits", &RowExchangePlan::send_splits)
      .def_readonly("recv_splits", &RowExchangePlan::recv_splits);
  m.def(
      "row_exchange_plan",
      [](const FlatLayout& layout, const std::vector<int64_t>& rows, int64_t rank, bool to_rows, int64_t only) {
        return row_exchange_plan(layout, rows, rank, to_rows ? ExchangeDirection::kToRows : ExchangeDirection::kFromRows,
                                 only);
      },
      py::arg("layout"), py::arg("rows"), py::arg("rank"), py::arg("to_rows"), py::arg("only") = -1,
      "The pieces one rank sends and receives to move between the layout and FSDP2's rows (row_exchange.h).");
  m.def(
      "chunk_rows",
      [](int64_t rows, int64_t world, int64_t rank) {
        const RowRange r = chunk_rows(rows, world, rank);
        return std::make_pair(r.begin, r.end);
      },
      py::arg("rows"), py::arg("world"), py::arg("rank"),
      "(begin, end): the rows of a dimension of `rows` that `rank` holds under torch.chunk (FSDP2's Shard).");
  m.def("row_slice", &row_slice, py::arg("layout"), py::arg("rows"), py::arg("param"), py::arg("rank"),
        "The elements of a parameter a rank holds under FSDP2's Shard(0) placement.");
  m.def(
      "balance_owners",
      [](const std::vector<double>& costs, int64_t world_size, std::vector<double> loads) {
        auto owners = balance_owners(costs, world_size, &loads);
        return std::make_pair(owners, loads);
      },
      py::arg("costs"), py::arg("world_size"), py::arg("loads") = std::vector<double>{},
      "(owners, loads): owner rank per parameter balancing the summed cost (largest first, "
      "least-loaded rank), starting from and returning the per-rank loads.");

  m.def(
      "pack_into_flat",
      [](at::Tensor& flat, const std::vector<std::optional<at::Tensor>>& tensors,
         const std::vector<int64_t>& offsets, bool accumulate, bool zero_fill_first, double scale) {
        std::vector<at::Tensor> ts;  // None -> undefined: skipped (and zero-filled)
        for (const auto& t : tensors) ts.push_back(t.value_or(at::Tensor()));
        pack_into_flat(flat, ts, offsets, accumulate, zero_fill_first, scale);
      },
      py::arg("flat"), py::arg("tensors"),
        py::arg("offsets"), py::arg("accumulate") = false, py::arg("zero_fill_first") = true, py::arg("scale") = 1.0,
        "Copy (or add) tensors, times `scale`, into a flat buffer at offsets, casting to its dtype.");
  m.def("cast_scale_into", &cast_scale_into, py::arg("dst"), py::arg("src"), py::arg("scale"),
        py::arg("accumulate") = false);

  py::enum_<VarAlgo>(m, "VarAlgo")
      .value("AUTO", VarAlgo::kAuto)
      .value("GROUPED", VarAlgo::kGrouped)
      .value("PADDED", VarAlgo::kPadded)
      .value("ALL_REDUCE", VarAlgo::kAllReduce);
  m.def("auto_var_algo", &auto_var_algo, py::arg("all_gather"), py::arg("grouped"), py::arg("total_numel"),
        py::arg("longest_numel"), py::arg("world"), py::arg("element_size"),
        "What VarAlgo.AUTO resolves to for an uneven collective of this shape.");
  m.attr("PADDED_ALL_GATHER_MIN_BYTES") = kPaddedAllGatherMinBytes;
  m.attr("DEFAULT_ALIGNMENT") = kDefaultAlignment;
  m.def("supported_float_dtypes", [] { return std::vector<at::ScalarType>(kSupportedFloats.begin(), kSupportedFloats.end()); },
        "The dtypes a unit may store, gather and reduce parameters in.");

  py::class_<BackendCaps>(m, "BackendCaps")
      .def(py::init([](std::string name, bool moves_data, bool enqueues_on_stream, bool flat_all_gather,
                       bool flat_reduce_scatter, bool coalesced_all_gather, bool coalesced_reduce_scatter,
                       bool uneven_lists, bool all_to_all) {
             BackendCaps c;
             c.name = std::move(name);
             c.moves_data = moves_data;
             c.enqueues_on_stream = enqueues_on_stream;
             c.flat_all_gather = flat_all_gather;
             c.flat_reduce_scatter = flat_reduce_scatter;
             c.coalesced_all_gather = coalesced_all_gather;
             c.coalesced_reduce_scatter = coalesced_reduce_scatter;
             c.uneven_lists = uneven_lists;
             c.all_to_all = all_to_all;
             return c;
           }),
           py::arg("name"), py::kw_only(), py::arg("moves_data") = true, py::arg("enqueues_on_stream") = false,
           py::arg("flat_all_gather") = true, py::arg("flat_reduce_scatter") = true,
           py::arg("coalesced_all_gather") = false, py::arg("coalesced_reduce_scatter") = false,
           py::arg("uneven_lists") = false, py::arg("all_to_all") = false)
      .def_readonly("name", &BackendCaps::name)
      .def_readonly("moves_data", &BackendCaps::moves_data)
      .def_readonly("enqueues_on_stream", &BackendCaps::enqueues_on_stream)
      .def_readonly("flat_all_gather", &BackendCaps::flat_all_gather)
      .def_readonly("flat_reduce_scatter", &BackendCaps::flat_reduce_scatter)
      .def_readonly("coalesced_all_gather", &BackendCaps::coalesced_all_gather)
      .def_readonly("coalesced_reduce_scatter", &BackendCaps::coalesced_reduce_scatter)
      .def_readonly("uneven_lists", &BackendCaps::uneven_lists)
      .def_readonly("all_to_all", &BackendCaps::all_to_all)
      .def("__repr__", [](const BackendCaps& c) {
        return msg("BackendCaps(name='", c.name, "', moves_data=", c.moves_data, ", enqueues_on_stream=",
                   c.enqueues_on_stream, ", flat_all_gather=", c.flat_all_gather, ", flat_reduce_scatter=",
                   c.flat_reduce_scatter, ", coalesced_all_gather=", c.coalesced_all_gather,
                   ", coalesced_reduce_scatter=", c.coalesced_reduce_scatter, ", uneven_lists=", c.uneven_lists,
                   ")");
      });
  m.def("backend_caps", [](const ProcessGroupPtr& pg, const c10::Device& device) {
          return backend_caps(pg, device.type());
        }, py::arg("process_group"), py::arg("device"),
        "What the group's backend can do for tensors of `device`'s type (None: it has no backend for them).");
  m.def("known_backend_caps", [](const std::string& name, const c10::Device& device) {
          return known_backend_caps(name, device.type());
        }, py::arg("name"), py::arg("device"), "The table's entry for a backend name and device type.");
  m.def("register_backend_caps", [](const c10::Device& device, const BackendCaps& caps) {
          register_backend_caps(device.type(), caps);
        }, py::arg("device"), py::arg("caps"));
  m.def("collective_counts", [] {
          py::dict out;
          for (int k = 0; k < kNumCollectiveKinds; ++k) {
            const auto kind = static_cast<CollectiveKind>(k);
            const auto c = collective_count(kind);
            out[collective_kind_name(kind)] = py::make_tuple(c.calls, c.bytes);
          }
          return out;
        }, "Collectives issued by this process, by kind: (c10d calls, bytes of each call's whole buffer).");
  m.def("reset_collective_counts", &reset_collective_counts);

  py::class_<Communicator, std::unique_ptr<Communicator, DeleteWithoutGil<Communicator>>>(m, "Communicator")
      .def(py::init<ProcessGroupPtr>(), py::arg("process_group"))
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def("all_gather_flat", &Communicator::all_gather_flat, py::arg("out"), py::arg("input"),
           py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter_flat", &Communicator::reduce_scatter_flat, py::arg("out"),
           py::arg("input"), py::call_guard<py::gil_scoped_release>())
      .def("all_gather_flat_coalesced", &Communicator::all_gather_flat_coalesced, py::arg("outs"),
           py::arg("inputs"), py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter_flat_coalesced", &Communicator::reduce_scatter_flat_coalesced, py::arg("outs"),
           py::arg("inputs"), py::call_guard<py::gil_scoped_release>())
      .def("all_reduce_sum", [](const Communicator& c, at::Tensor& t) {
        py::gil_scoped_release no_gil;
        c.all_reduce(t, c10d::ReduceOp::SUM);
      })
      // verify: first check with one small all-gather that every rank passed the same
      // segment table (a mismatch would otherwise crash or corrupt silently).
      .def("all_gather_v", &Communicator::all_gather_v, py::arg("out"), py::arg("input"),
           py::arg("starts"), py::arg("numels"), py::arg("algo") = VarAlgo::kAuto, py::arg("verify") = true,
           py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter_v", &Communicator::reduce_scatter_v, py::arg("out"), py::arg("input"),
           py::arg("starts"), py::arg("numels"), py::arg("algo") = VarAlgo::kAuto, py::arg("verify") = true,
           py::call_guard<py::gil_scoped_release>())
      .def("broadcast", &Communicator::broadcast, py::arg("tensor"), py::arg("root"),
           py::call_guard<py::gil_scoped_release>());

  py::class_<PendingCollective, std::shared_ptr<PendingCollective>>(m, "PendingCollective")
      .def("wait", &PendingCollective::wait, "Make the current stream wait for the collective.");

  py::class_<CommContext, std::shared_ptr<CommContext>>(m, "CommContext")
      .def(py::init([](c10::Device device) { return make_shared_without_gil_delete<CommContext>(device); }),
           py::arg("device"))
      .def_property_readonly("device", &CommContext::device)
      .def_property_readonly("num_inflight_reductions", &CommContext::num_inflight_reductions)
      .def("wait_reductions", &CommContext::wait_reductions, py::call_guard<py::gil_scoped_release>())
      .def("synchronize_reductions", &CommContext::synchronize_reductions,
           "wait_reductions(), then the host waits for every reduction issued (offloaded gradients).",
           py::call_guard<py::gil_scoped_release>())
      .def("all_gather_v_async", &CommContext::all_gather_v_async, py::arg("comm"), py::arg("out"),
           py::arg("input"), py::arg("starts"), py::arg("numels"), py::arg("algo") = VarAlgo::kAuto,
           py::arg("verify") = true, py::call_guard<py::gil_scoped_release>())
      .def("all_gather_stream", [](const CommContext& c) -> py::object {
        if (!c.streams().enabled()) return py::none();
        return py::cast(c.streams().all_gather());
      })
      .def("reduce_scatter_stream", [](const CommContext& c) -> py::object {
        if (!c.streams().enabled()) return py::none();
        return py::cast(c.streams().reduce_scatter());
      })
      .def_property_readonly("nonfinite_flag", [](const CommContext& c) -> py::object {
        if (!c.nonfinite_flag().defined()) return py::none();
        return py::cast(c.nonfinite_flag());
      }, "1-element device tensor: 1 once a checked gradient held NaN/Inf (None before any check).")
      .def_property("fault_delay_cycles", &CommContext::fault_delay_cycles, &CommContext::set_fault_delay_cycles,
                    "Tests only: GPU cycles each side stream busy-waits after a collective, before its results "
                    "land and its done event is recorded (0: off).");

  // The strategy carries its meaning (csrc/strategy.h): Python asks these properties.
  py::enum_<ShardingStrategy>(m, "ShardingStrategy")
      .value("NO_SHARD", ShardingStrategy::kNoShard)
      .value("OPTIM", ShardingStrategy::kOptim)
      .value("OPTIM_GRADS", ShardingStrategy::kOptimGrads)
      .value("OPTIM_GRADS_PARAMS", ShardingStrategy::kOptimGradsParams)
      .def_static("from_name", &strategy_from_name, py::arg("name"),
                  "The strategy with this Megatron-FSDP name; an unknown name raises ValueError.")
      .def_property_readonly("megatron_name", [](ShardingStrategy s) { return std::string(traits(s).name); })
      .def_property_readonly("replicated", [](ShardingStrategy s) { return traits(s).replicated; },
                             "Every rank holds every parameter in full; nothing is gathered.")
      .def_property_readonly("gathers", [](ShardingStrategy s) { return traits(s).gathers(); },
                             "Parameters are all-gathered before use.")
      .def_property_readonly("keeps_unsharded", [](ShardingStrategy s) { return traits(s).keeps_unsharded; },
                             "The unsharded parameters stay allocated between uses (False: ZeRO-3).")
      .def_property_readonly("keeps_gathered", [](ShardingStrategy s) { return traits(s).keeps_gathered(); },
                             "A gathered copy is kept between uses (optim, optim_grads).")
      .def_property_readonly("full_grads", [](ShardingStrategy s) { return traits(s).full_grads; },
                             "Gradients are all-reduced in full, one unit at a time (False: reduce-scattered).");
  m.def("sharding_strategies", [] {
    std::vector<ShardingStrategy> all;
    for (const auto& t : kStrategies) all.push_back(t.strategy);
    return all;
  }, "Every strategy, in the order of csrc/strategy.h's table.");

  py::enum_<GatherTransform>(m, "GatherTransform")
      .value("NONE", GatherTransform::kNone)
      .value("CAST", GatherTransform::kCast)
      .value("FP8", GatherTransform::kFp8)
      .value("MXFP8", GatherTransform::kMxfp8);

  py::class_<GatherBytes>(m, "GatherBytes", "Byte layout of a gather in dtypes of several widths (csrc/gather_bytes.h).")
      .def_readonly("param_starts", &GatherBytes::param_starts)
      .def_readonly("segment_starts", &GatherBytes::segment_starts)
      .def_readonly("segment_bytes", &GatherBytes::segment_bytes)
      .def_readonly("total", &GatherBytes::total);
  m.def("gather_bytes_of", &gather_bytes_of, py::arg("layout"), py::arg("widths"),
        "The byte layout of `layout` gathered with `widths` bytes per element of each parameter.");

  py::class_<ParamSpec>(m, "ParamSpec", "One parameter of a unit as the library sees it (csrc/param_spec.h).")
      .def_readonly("name", &ParamSpec::name)
      .def_property_readonly("shape", [](const ParamSpec& p) { return py::tuple(py::cast(p.shape)); })
      .def_property_readonly("numel", &ParamSpec::numel)
      .def_property_readonly("dtype", [](const ParamSpec& p) { return py::cast(p.dtype); })
      .def_property_readonly("gather_dtype", [](const ParamSpec& p) { return py::cast(p.gather_dtype); })
      .def_readonly("transform", &ParamSpec::transform)
      .def_readonly("storage_device", &ParamSpec::storage_device)
      .def_readonly("slice", &ParamSpec::slice)
      .def_readonly("state_dict_dim", &ParamSpec::state_dict_dim)
      .def("__repr__", [](const ParamSpec& p) {
        return "ParamSpec('" + p.name + "', shape=" + c10::str(c10::IntArrayRef(p.shape)) + ", dtype=" + c10::toString(p.dtype) +
               ", gather=" + gather_transform_name(p.transform) + ":" + c10::toString(p.gather_dtype) +
               ", device=" + p.storage_device.str() + ", slice=[" + std::to_string(p.slice.param_offset) + "+" +
               std::to_string(p.slice.numel) + "])";
      });

  py::enum_<CommBufferSource>(m, "CommBufferSource", "Where a unit's all-gather output and reduce-scatter input "
                             "are allocated (csrc/comm_buffers.h).")
      .value("CACHING_ALLOCATOR", CommBufferSource::kCachingAllocator)
      .value("PROCESS_GROUP", CommBufferSource::kProcessGroup);

  py::enum_<UnitState>(m, "UnitState")
      .value("SHARDED", UnitState::kSharded)
      .value("GATHERING", UnitState::kGathering)
      .value("UNSHARDED", UnitState::kUnsharded);

  // Every Unit method that may wait on a collective releases the GIL: a Gloo worker
  // thread finishing an earlier Python-issued collective needs it to free tensors.
  py::class_<Unit, std::shared_ptr<Unit>>(m, "Unit")
      .def(py::init([](const std::vector<at::Tensor>& params, std::vector<std::string> names, ProcessGroupPtr pg,
                       int64_t alignment, std::optional<at::ScalarType> param_dtype,
                       std::optional<at::ScalarType> reduce_dtype, ShardingStrategy strategy,
                       std::optional<c10::Device> materialize_on) {
             return make_shared_without_gil_delete<Unit>(params, std::move(names), std::move(pg), alignment,
                                                         param_dtype, reduce_dtype, strategy, materialize_on);
           }),
           py::arg("params"), py::arg("names"), py::arg("process_group"), py::arg("alignment") = kDefaultAlignment,
           py::arg("param_dtype") = py::none(), py::arg("reduce_dtype") = py::none(),
           py::arg("strategy") = ShardingStrategy::kOptimGradsParams, py::arg("materialize_on") = py::none())
      .def_property_readonly("label", &Unit::label)
      .def("set_label", &Unit::set_label, py::arg("label"))
      .def_property("check_collectives", &Unit::check_collectives, &Unit::set_check_collectives)
      .def_property("check_nonfinite", &Unit::check_nonfinite, &Unit::set_check_nonfinite)
      .def("set_comm_buffer_source", &Unit::set_comm_buffer_source, py::arg("source"),
           "Where the all-gather output and reduce-scatter input come from (no collective). Returns whether the "
           "unit's groups can allocate device memory at all.")
      .def_property_readonly("comm_buffer_source", &Unit::comm_buffer_source)
      .def_property_readonly("gather_buffer_from_group", &Unit::gather_buffer_from_group)
      .def_property_readonly("reduce_buffer_from_group", &Unit::reduce_buffer_from_group)
      .def_property_readonly("unsharded_from_group", &Unit::unsharded_from_group)
      .def_property("gradient_divide_factor", &Unit::gradient_divide_factor, &Unit::set_gradient_divide_factor)
      .def_property_readonly("strategy", &Unit::strategy)
      .def_property_readonly("param_specs", &Unit::param_specs, py::return_value_policy::copy)
      .def("param_spec", [](const Unit& u, int64_t index) { return u.param_specs().at(index); }, py::arg("index"),
           "param_specs[index] without copying the others.")
      .def_property_readonly("gather_transform", &Unit::gather_transform)
      .def("offload_to_host", &Unit::offload_to_host, py::arg("pin_memory"),
           "Keep the shard and its gradient in host memory (before bind_params).")
      .def_property_readonly("offloaded", &Unit::offloaded)
      .def("move_shard_to", &Unit::move_shard_to, py::arg("device"),
           "Move the shard, and every sharded parameter with it, to `device` (module.to()).")
      .def_property_readonly("shard_device", &Unit::shard_device)
      .def_property_readonly("pinned", &Unit::pinned)
      .def_property_readonly("host_gather_copy", &Unit::host_gather_copy)
      .def("mark_host_copy_fresh", &Unit::mark_host_copy_fresh)
      .def_property_readonly("host_copy_fresh", &Unit::host_copy_fresh)
      .def_property_readonly("host_nbytes", &Unit::host_nbytes)
      .def("set_host_update", &Unit::set_host_update, py::arg("task"), py::call_guard<py::gil_scoped_release>())
      .def("wait_host_update", &Unit::wait_host_update, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("host_update_pending", &Unit::host_update_pending)
      .def("set_fp8_gather", &Unit::set_fp8_gather, py::arg("params"), py::arg("fp8_dtype"),
           "Gather parameters `params` in FP8 with tensorwise scales (before bind_params).")
      .def("set_mx_gather", &Unit::set_mx_gather, py::arg("params"), py::arg("block") = 32,
           "Gather parameters `params` in MXFP8 from block-aligned shards (before bind_params).")
      .def_property_readonly("mx_block", &Unit::mx_block)
      .def_property_readonly("mx_data", &Unit::mx_data)
      .def_property_readonly("mx_scales", &Unit::mx_scales)
      .def("mx_scale_views", &Unit::mx_scale_views)
      .def("mark_quantized", &Unit::mark_quantized)
      .def_property_readonly("gathers_bytes", &Unit::gathers_bytes)
      .def_property_readonly("gather_bytes", &Unit::gather_bytes, py::return_value_policy::copy)
      .def_property_readonly("fp8_scales", &Unit::fp8_scales)
      .def_property_readonly("fp8_scales_stale", &Unit::fp8_scales_stale)
      .def_static("refresh_fp8_scales", &Unit::refresh_fp8_scales, py::arg("units"), py::arg("only_stale") = true,
                  "Recompute the FP8 scales of `units` (one all-reduce(max) per all-gather group).",
                  py::call_guard<py::gil_scoped_release>())
      .def("gather_full", &Unit::gather_full, py::arg("pieces"), py::arg("dtype"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("exchanges_rows", &Unit::exchanges_rows)
      .def("set_state_dict_dims", &Unit::set_state_dict_dims, py::arg("dims"))
      .def("to_row_chunks", &Unit::to_row_chunks, py::arg("pieces"), py::arg("dtype"),
           "This rank's FSDP2 (torch.chunk, dim 0) rows of every parameter (pieces=[]: the parameters "
           "themselves), by one all-to-all over the unit's group.",
           py::call_guard<py::gil_scoped_release>())
      .def("piece_from_rows", &Unit::piece_from_rows, py::arg("index"), py::arg("rows"),
           "This rank's 1-D piece of parameter `index` from every rank's FSDP2 rows of it (one all-to-all).",
           py::call_guard<py::gil_scoped_release>())
      .def("local_piece", &Unit::local_piece, py::arg("index"), py::arg("full"),
           "This rank's 1-D piece (a view) of parameter `index`'s full value.")
      .def_property_readonly("shard_index", &Unit::shard_index)
      .def_property_readonly("layout", &Unit::layout, py::return_value_policy::reference_internal)
      .def_property_readonly("rank", &Unit::rank)
      .def_property_readonly("world_size", &Unit::world_size)
      .def_property_readonly("state", &Unit::state)
      .def_property_readonly("device", &Unit::device)
      .def_property_readonly("orig_dtype", &Unit::orig_dtype)
      .def_property_readonly("param_dtype", &Unit::param_dtype)
      .def_property_readonly("reduce_dtype", &Unit::reduce_dtype)
      .def_property_readonly("sharded_flat", &Unit::sharded_flat)
      .def_property_readonly("unsharded_storage_bytes", &Unit::unsharded_storage_bytes)
      .def_property_readonly("unsharded_nbytes", &Unit::unsharded_nbytes)
      .def("sharded_views", &Unit::sharded_views)
      .def("unsharded_views", &Unit::unsharded_views)
      .def("bind_params", &Unit::bind_params, py::arg("sharded_params"), py::arg("unsharded_params"),
           py::arg("unsharded_locals") = std::vector<at::Tensor>{})
      // The unit is the one holder of these objects: each read gives the very objects
      // bind_params got (type and attributes included), in a new list.
      .def_property_readonly("sharded_params", &Unit::sharded_params,
                             "The parameters the module shows between uses: 1-D views of this rank's shard.")
      .def_property_readonly("unsharded_params", &Unit::unsharded_params,
                             "The parameters the module shows in forward/backward: views of the gathered buffer.")
      .def_property_readonly("unsharded_locals", &Unit::unsharded_locals,
                             "Where the unit reads each unsharded gradient: the unsharded parameters, or for one "
                             "shown wrapped (a tensor-parallel DTensor) its local view.")
      .def("retype_grads", &retype_grads, py::arg("from_types"), py::arg("to_types"),
           "Set the Python type of each sharded parameter's .grad from from_types[index] to to_types[index] "
           "(None: leave it): the ShardedGrad subclass through which torch's norm code reduces it (grad_norm.py), "
           "and back.")
      .def("sharded_param", [](const Unit& u, int64_t index) { return u.sharded_params().at(index); },
           py::arg("index"), "sharded_params[index] without building the list.")
      .def("unsharded_param", [](const Unit& u, int64_t index) { return u.unsharded_params().at(index); },
           py::arg("index"), "unsharded_params[index] without building the list.")
      .def("set_context", &Unit::set_context)
      // Replacing a group may drop the last reference to the previous one.
      .def("set_all_gather_group", &Unit::set_all_gather_group, py::call_guard<py::gil_scoped_release>())
      .def("set_reduce_scatter_group", &Unit::set_reduce_scatter_group,
           py::call_guard<py::gil_scoped_release>())
      .def("set_replicate_group", &Unit::set_replicate_group, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("replicate_size", &Unit::replicate_size)
      .def_property_readonly("replicate_rank", &Unit::replicate_rank)
      .def_property("requires_all_reduce", &Unit::requires_all_reduce, &Unit::set_requires_all_reduce)
      .def_property_readonly("has_partial_reduction", &Unit::has_partial_reduction)
      .def("unshard", &Unit::unshard, py::call_guard<py::gil_scoped_release>())
      .def("wait_unshard", &Unit::wait_unshard, py::call_guard<py::gil_scoped_release>())
      .def_static("unshard_together", &Unit::unshard_together, py::arg("units"),
                  py::call_guard<py::gil_scoped_release>(),
                  "unshard() for several units, those that can share it in one coalesced all-gather")
      .def_static("unshard_all", &Unit::unshard_all, py::arg("units"), py::arg("bucketed"),
                  py::call_guard<py::gil_scoped_release>(),
                  "unshard_together(units) when bucketed and several, else each unit's unshard()")
      .def("reshard", &Unit::reshard, py::arg("keep_post_forward") = false, py::call_guard<py::gil_scoped_release>(),
           "Free the unsharded storage; keep_post_forward keeps this rank's 1/N of it first when the unit has a "
           "post-forward group (reshard_after_forward=int), which the next unshard() gathers from.")
      .def("set_post_forward_group", &Unit::set_post_forward_group, py::arg("group"),
           py::call_guard<py::gil_scoped_release>(),
           "FSDP2's reshard_after_forward=int: N consecutive ranks of the shard group, this rank among them.")
      .def_property_readonly("post_forward_size", &Unit::post_forward_size,
                             "N of reshard_after_forward=int (0: no post-forward group)")
      .def_property_readonly("post_forward_nbytes", &Unit::post_forward_nbytes,
                             "Bytes of the copy kept after forward (0: none kept)")
      .def("shard_changed", &Unit::shard_changed, py::arg("index") = py::none(), py::arg("value") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("reduce_grads", &Unit::reduce_grads, py::arg("sync"), py::arg("may_join") = true,
           py::call_guard<py::gil_scoped_release>())
      .def("drop_unreduced_grads", &Unit::drop_unreduced_grads, py::call_guard<py::gil_scoped_release>())
      .def("expect_reduction", &Unit::expect_reduction,
           "The unit's forward ran with grad on this rank: its next synced reduction runs on every rank")
      .def_property_readonly("can_share_reduction", &Unit::can_share_reduction)
      .def_static("reduce_together", &Unit::reduce_together, py::arg("units"), py::arg("may_join") = true,
                  py::call_guard<py::gil_scoped_release>(),
                  "reduce_grads(True) for several units, those that can share it in one coalesced reduce-scatter")
      .def("gather_full_params", &Unit::gather_full_params, py::call_guard<py::gil_scoped_release>());

  m.def("set_post_backward_callback", &set_post_backward_callback, py::arg("callback"),
        "The callable that gets a unit's key when the backward of one of its forward calls is done.");
  m.def("mark_post_backward", &mark_post_backward, py::arg("key"), py::arg("inputs"),
        "`inputs` through an identity autograd node whose backward reports `key` to the callback.");

  // use() and release() drop the GIL themselves around the collectives they wait on.
  py::class_<ParamSlots>(m, "ParamSlots")
      .def(py::init<std::shared_ptr<Unit>>(), py::arg("unit"))
      .def("add", &ParamSlots::add, py::arg("params_dict"), py::arg("name"), py::arg("param_index"))
      .def("install", &ParamSlots::install, py::arg("unsharded"))
      .def("use", &ParamSlots::use, py::arg("gathers"), py::arg("bucketed"),
           "Gather `gathers` (one coalesced all-gather when bucketed), wait for this unit's gather and install "
           "the unsharded parameters; returns the slots the user re-assigned.")
      .def("release", &ParamSlots::release, py::arg("keep_unsharded"), py::arg("keep_post_forward") = false,
           "Reshard unless keep_unsharded (keeping the post-forward copy when asked, Unit::reshard) and install "
           "the sharded parameters (kept: only if the slots hold the unsharded ones); returns the slots the user "
           "re-assigned.")
      .def_property_readonly("holds_unsharded", &ParamSlots::holds_unsharded)
      .def("param_index", &ParamSlots::param_index)
      .def("params_dict", &ParamSlots::params_dict)
      .def("name", &ParamSlots::name)
      .def("__len__", &ParamSlots::size);
}
