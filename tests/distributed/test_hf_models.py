"""Hugging Face models (tiny LlamaForCausalLM and GPT2LMHeadModel built from configs, tied
embeddings) sharded with fully_shard, against the same model in plain single-process
PyTorch: training parity with gradient checkpointing, generate(), num_parameters(),
save_pretrained() -> from_pretrained(), a safetensors checkpoint loaded into a sharded
model, and a DCP round trip through torch's state-dict helpers."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

import megatron_fsdp_ext as mfsdp
from harness import run_distributed

transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (test extra)")
VOCAB = 64
TOL = dict(rtol=2e-5, atol=2e-6)


def _build(arch, seed=0):
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=True)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _layers(model):
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def _shard(model):
    for layer in _layers(model):
        mfsdp.fully_shard(layer)
    return mfsdp.fully_shard(model)


def _batch(step):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, VOCAB, (4, 10), generator=g)


def _train(model, opt, steps, rows=None):
    losses = []
    for step in range(steps):
        ids = _batch(step)
        if rows is not None:
            ids = ids[rows]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _opt(model):
    # SGD: Adam's normalised update turns rounding-level gradient differences of
    # near-zero gradients (GPT-2's zero-initialised biases) into visible ones.
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _assert_equal_to(full_sd, ref):
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full_sd[k], v, **TOL, msg=lambda m: f"{k}: {m}")


def _hf_worker(rank, world, arch, pretrained_dir, out_dir, ckpt_dir):
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    ref = _build(arch)
    model = _shard(copy.deepcopy(ref))
    assert model.num_parameters() == ref.num_parameters()
    assert model.num_parameters(exclude_embeddings=True) == ref.num_parameters(exclude_embeddings=True)

    # training parity (gradient checkpointing on both), each rank its rows
    for m in (ref, model):
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_opt, opt = _opt(ref), _opt(model)
    ref_losses = [ref(input_ids=_batch(s)[rows], labels=_batch(s)[rows]).loss.item() for s in range(1)]
    _train(ref, ref_opt, 2)
    losses = _train(model, opt, 2, rows=rows)
    assert abs(losses[0].item() - ref_losses[0]) < 1e-5, (losses[0].item(), ref_losses[0])
    _assert_equal_to(mfsdp.full_state_dict(model, rank0_only=False), ref)

    # generate() through the registered forward method
    for m in (ref, model):
        m.eval()
    mfsdp.register_fsdp_forward_method(model, "generate")
    prompt = _batch(9)[:2, :4]
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), ref.generate(prompt, **kwargs))

    # save_pretrained writes full tensors (collective; rank 0 writes)
    model.save_pretrained(out_dir)

    # DCP round trip through torch's helpers into a fresh sharded model
    dcp.save(get_model_state_dict(model), checkpoint_id=ckpt_dir)
    fresh = _shard(_build(arch, seed=3))
    sd = get_model_state_dict(fresh)
    dcp.load(sd, checkpoint_id=ckpt_dir)
    set_model_state_dict(fresh, sd)
    _assert_equal_to(mfsdp.full_state_dict(fresh, rank0_only=False), ref)

    # a safetensors checkpoint (written by plain from/save_pretrained) into a sharded model
    from safetensors.torch import load_file

    original = _build(arch)  # what pretrained_dir holds
    target = _shard(_build(arch, seed=4))
    files = load_file(f"{pretrained_dir}/model.safetensors")
    set_model_state_dict(target, files, options=StateDictOptions(full_state_dict=True, strict=False))
    _assert_equal_to(mfsdp.full_state_dict(target, rank0_only=False), original)
    return True


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_model_sharded_matches_plain(arch, tmp_path):
    pretrained = tmp_path / "pretrained"
    _build(arch).save_pretrained(pretrained)
    args = (arch, str(pretrained), str(tmp_path / "saved"), str(tmp_path / "dcp"))
    assert run_distributed(_hf_worker, 2, *args, timeout=300) == [True, True]
    # what save_pretrained wrote is the trained model, loadable without the library
    ref = _build(arch)
    opt = _opt(ref)
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref.train()
    _train(ref, opt, 2)
    back = type(ref).from_pretrained(tmp_path / "saved")
    _assert_equal_to(back.state_dict(), ref)


def _bucketed_worker(rank, world, arch):
    """FSDPConfig(bucket_size=...) on a Hugging Face model: units are decoder layers (or
    their attention/MLP), never the layers' ModuleList or one end of the tied embedding."""
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    ref = _build(arch)
    model = copy.deepcopy(ref)
    mfsdp.fully_shard_model(model, mfsdp.FSDPConfig(bucket_size=2000))
    units = [s.module for s in mfsdp.core.param_index.iter_states(model)]
    assert len(units) > 2, [type(u).__name__ for u in units]
    assert not any(isinstance(u, torch.nn.ModuleList) for u in units)
    emb = model.get_input_embeddings()
    assert emb not in units and model.get_output_embeddings() not in units
    ref_opt, opt = _opt(ref), _opt(model)
    _train(ref, ref_opt, 2)
    _train(model, opt, 2, rows=rows)
    _assert_equal_to(mfsdp.full_state_dict(model, rank0_only=False), ref)
    return True


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_model_bucketed_units(arch):
    assert run_distributed(_bucketed_worker, 2, arch, timeout=180) == [True, True]


def _native_fsdp_worker(rank, world, pretrained_dir):
    """transformers' own FSDP2 path, from_pretrained(distributed_config=...), with ours
    swapped in where it looks fully_shard up: refused by name at the first call, on every
    rank, where it once failed later with a shape mismatch (its loader cuts FSDP2's rows
    and compares them with our parameters) or broadcast rank 0's pieces over the others'."""
    import transformers.distributed.fsdp as hf_fsdp
    from transformers.distributed import DistributedConfig
    from harness.workers import expect_error

    # Swapped in directly, and through a script's own wrapper.
    for swap in (mfsdp.fully_shard, lambda *args, **kwargs: mfsdp.fully_shard(*args, **kwargs)):
        hf_fsdp.fully_shard = swap
        expect_error(lambda: transformers.LlamaForCausalLM.from_pretrained(
            pretrained_dir, distributed_config=DistributedConfig(fsdp_size=world)),
            NotImplementedError, "transformers.distributed.fsdp", "without distributed_config")
    return True


def test_transformers_native_fsdp_loading_is_refused_by_name(tmp_path):
    _build("llama").save_pretrained(str(tmp_path))
    assert run_distributed(_native_fsdp_worker, 2, str(tmp_path), timeout=240) == [True, True]


class _KeysOfAModule(transformers.LlamaForCausalLM):
    """A save_pretrained that lists a module's keys through its state_dict(), as PEFT's
    does for modules_to_save (ModulesToSaveWrapper.adapter_state_dict)."""

    def save_pretrained(self, save_directory, *args, state_dict=None, **kwargs):
        keys = list(self.lm_head.state_dict())
        torch.save({k: state_dict[f"lm_head.{k}"] for k in keys}, f"{save_directory}/lm_head.pt")


def _save_lists_keys_worker(rank, world, out_dir):
    """The writer alone runs the library's save: a state_dict() it calls on a submodule
    once gathered on that rank only and waited silently; the file holds the full values."""
    ref = _build("llama")
    model = _KeysOfAModule(ref.config)
    model.load_state_dict(ref.state_dict())
    _shard(model)
    model.save_pretrained(out_dir)
    dist.barrier()
    saved = torch.load(f"{out_dir}/lm_head.pt")
    assert torch.equal(saved["weight"], ref.lm_head.weight), "the written lm_head is not the full value"
    return True


def test_save_pretrained_that_reads_a_submodules_state_dict(tmp_path):
    assert run_distributed(_save_lists_keys_worker, 2, str(tmp_path), timeout=120) == [True, True]
