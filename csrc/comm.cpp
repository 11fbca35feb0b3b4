#include "comm.h"

namespace mfsdp {

Communicator::Communicator(ProcessGroupPtr pg) : pg_(std::move(pg)) {
  MFSDP_CHECK(pg_, "Communicator: process group is null");
  rank_ = pg_->getRank();
  size_ = pg_->getSize();
}

void Communicator::finish(const c10::intrusive_ptr<c10d::Work>& work) {
  // NCCL with asyncOp=false may return no Work at all: the collective is already
  // ordered on the current stream. Gloo always returns one and finishes it in wait().
  if (work) work->wait();
}

void Communicator::all_gather_flat(at::Tensor& out, at::Tensor& in) const {
  MFSDP_CHECK(out.numel() == in.numel() * size_, "all_gather_flat: output has ", out.numel(),
              " elements, expected ", in.numel(), " x ", size_);
  MFSDP_CHECK(out.scalar_type() == in.scalar_type(), "all_gather_flat: dtype mismatch ",
              out.scalar_type(), " vs ", in.scalar_type());
  if (size_ == 1) {
    if (!out.is_same(in) && out.data_ptr() != in.data_ptr()) out.copy_(in);
    return;
  }
  if (out.numel() == 0) return;
  c10d::AllgatherOptions opts;
  opts.asyncOp = false;
  finish(pg_->_allgather_base(out, in, opts));
}

void Communicator::reduce_scatter_flat(at::Tensor& out, at::Tensor& in) const {
  MFSDP_CHECK(in.numel() == out.numel() * size_, "reduce_scatter_flat: input has ", in.numel(),
              " elements, expected ", out.numel(), " x ", size_);
  MFSDP_CHECK(out.scalar_type() == in.scalar_type(), "reduce_scatter_flat: dtype mismatch ",
              out.scalar_type(), " vs ", in.scalar_type());
  if (size_ == 1) {
    if (out.data_ptr() != in.data_ptr()) out.copy_(in);
    return;
  }
  if (out.numel() == 0) return;
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;  // SUM then scale: AVG was unreliable on Gloo
  opts.asyncOp = false;
  finish(pg_->_reduce_scatter_base(out, in, opts));
}

void Communicator::all_reduce(at::Tensor& t, c10d::ReduceOp::RedOpType op) const {
  if (size_ == 1 || t.numel() == 0) return;
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp(op);
  opts.asyncOp = false;
  finish(pg_->allreduce(tensors, opts));
}

void Communicator::broadcast(at::Tensor& t, int root) const {
  if (size_ == 1 || t.numel() == 0) return;
  std::vector<at::Tensor> tensors{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.asyncOp = false;
  finish(pg_->broadcast(tensors, opts));
}

}  // namespace mfsdp
