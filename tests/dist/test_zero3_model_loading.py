"""Loading weights into a model built partitioned, before any engine exists (2 gloo ranks): what
transformers does under DeepSpeed's `zero.Init` (`HfDeepSpeedConfig` + `from_pretrained`), which runs
each module's initializer and then the checkpoint load inside `GatheredParameters(params, modifier_rank=0)`
with only rank 0 writing. Every rank must end with its slice of rank 0's values, and the engine must
train from those."""

import pytest
import torch
import torch.distributed as dist

import zerodp
from zerodp.errors import PartitionedParameterError
from zerodp.shard.stage3 import PartitionedParameter

CFG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def init_context_write_case():
    rank = dist.get_rank()
    torch.manual_seed(rank)  # each rank draws other initial values: only rank 0's may survive
    with zerodp.init_context(CFG):
        lin = torch.nn.Linear(5, 3)  # 15 and 3 elements: neither a multiple of the world size
    built_partitioned = isinstance(lin.weight, PartitionedParameter) and isinstance(lin.bias, PartitionedParameter)
    keys = lin.state_dict()  # before the engine: names, shapes and dtypes, no values (meta tensors)
    state_dict_meta = all(t.is_meta for t in keys.values()) and keys["weight"].shape == (3, 5)
    written = torch.arange(15.0).view(3, 5), torch.full((3,), 7.0)
    with zerodp.gathered_parameters(lin.parameters(), modifier_rank=0), torch.no_grad():
        if rank == 0:
            lin.weight.copy_(written[0])
            lin.bias.copy_(written[1])
        else:
            lin.weight.fill_(-1.0)  # not the modifier rank: discarded
    partitioned_again = isinstance(lin.weight, PartitionedParameter)
    with zerodp.gathered_parameters([lin.weight, lin.bias]), torch.no_grad():  # read-only: a write is discarded
        seen = lin.weight.detach().clone(), lin.bias.detach().clone()
        lin.weight.add_(100.0)
    engine = zerodp.initialize(lin, torch.optim.SGD(lin.parameters(), lr=0.0), CFG)
    with zerodp.gathered_parameters(lin.parameters()):
        in_engine = lin.weight.detach().clone(), lin.bias.detach().clone()
    try:  # in the engine, a partitioned parameter's detach is refused again (its values exist, sharded)
        lin.weight.detach()
        refused_in_engine = False
    except PartitionedParameterError:
        refused_in_engine = True
    del engine
    return built_partitioned and state_dict_meta, partitioned_again and refused_in_engine, seen, in_engine, written


@pytest.mark.parametrize("world", [2])
def test_gathered_write_before_the_engine_keeps_the_modifier_ranks_values(dist_run, world):
    for built, again, seen, in_engine, written in dist_run(world, init_context_write_case, timeout=60):
        assert built and again
        assert torch.equal(seen[0], written[0]) and torch.equal(seen[1], written[1])
        assert torch.equal(in_engine[0], written[0]) and torch.equal(in_engine[1], written[1])


def hf_zero3_from_pretrained_case(folder):
    """transformers' ZeRO-3 path over zerodp.deepspeed (the `deepspeed` alias): the loaded model equals
    the one from_pretrained builds whole."""
    import sys

    import transformers
    from accelerate.utils.deepspeed import HfDeepSpeedConfig
    from transformers.integrations import deepspeed as hf_deepspeed

    from zerodp.adapters.deepspeed import alias

    rank = dist.get_rank()
    path = f"{folder}/tiny_opt"
    if rank == 0:
        torch.manual_seed(0)
        transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=40, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2,
            max_position_embeddings=32, word_embed_proj_dim=16, bos_token_id=0, eos_token_id=0, pad_token_id=1,
        )).save_pretrained(path)
    dist.barrier()
    whole = transformers.OPTForCausalLM.from_pretrained(path)
    saved = {k: v for k, v in sys.modules.items() if k == "deepspeed" or k.startswith("deepspeed.")}
    saved_path = list(sys.meta_path)
    alias.install()
    # transformers' HfDeepSpeedConfig is accelerate's plus a version check of the `deepspeed` distribution
    # (tests/unit/adapters/test_deepspeed_modules.py); this worker may have imported transformers before the alias,
    # so the config is registered directly, as HfDeepSpeedConfig.__init__ does
    config = HfDeepSpeedConfig(dict(CFG, train_micro_batch_size_per_gpu=1))
    hf_deepspeed.set_hf_deepspeed_config(config)
    try:
        torch.manual_seed(1 + rank)  # the ranks' initializers draw differently: rank 0 writes, the load wins
        model = transformers.OPTForCausalLM.from_pretrained(path)
        partitioned = all(isinstance(p, PartitionedParameter) for p in model.parameters())
        with zerodp.gathered_parameters(model.parameters()):
            loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()
        for k in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
            del sys.modules[k]
        sys.modules.update(saved)
        sys.meta_path[:] = saved_path
    return partitioned, loaded, {n: p.detach() for n, p in whole.named_parameters()}


# Partitioned for real (threshold 0), unlike the DeepSpeed-Chat stage-3 case, whose tiny model's parameters
# are all under its config's stage3_param_persistence_threshold (1e4). transformers' loader also calls
# `model.state_dict()` for the key names on the partitioned model: meta tensors before the engine.
@pytest.mark.parametrize("world", [2])
def test_transformers_zero3_from_pretrained_loads_every_weight(dist_run, world, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    for partitioned, loaded, whole in dist_run(world, hf_zero3_from_pretrained_case, str(tmp_path), timeout=120):
        assert partitioned
        assert loaded.keys() == whole.keys()
        for name in whole:
            assert torch.equal(loaded[name], whole[name]), name
