"""Training a Hugging Face folder on a prompt dataset, and saving it back
(``nereus_rl.train(model=FOLDER, data=FILE, reward_fn=...)``).

The checkpoints are tiny random models made by transformers in the test and saved to a
temporary folder (nothing is downloaded): a LlamaForCausalLM with grouped-query
attention and rope theta 5e5, and a Qwen2ForCausalLM with q/k/v biases and tied
embeddings. Their tokenizer is a word-level one trained with the tokenizers library on
the shipped dataset (``arith_word.jsonl``) and saved beside them, with a chat template
on the Qwen2 one.

The slow cases run short GRPO and PPO runs on worker processes (tp 2, pp 2), then load
the saved policy (and PPO's critic) with transformers: its logits (values) equal ours
for the same folder, bitwise in fp32 on one process, and the saved tensors are the
live training shards. The fast cases are the bad inputs, each refused before any
process starts with an error that names the file and row, or the function.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from nereus_rl.data import ARITH_WORD
from nereus_rl.data.datasets import DatasetError, OptionalDependencyError
from nereus_rl.data.rewards import RewardFnError
from nereus_rl.data.tokenizers import TokenizerError, import_transformers
from nereus_rl.models.hf import HFCheckpointError, hf_config, hf_name, load_hf_weights, save_hf
from nereus_rl.models.model import Decoder, ModelConfig, state_specs
from nereus_rl.trainer.config import TrainConfigError, simple_plan

try:  # with the source root off sys.path (its kernels/ shadows Hugging Face's kernels)
    transformers = import_transformers()
except OptionalDependencyError:
    pytest.skip("transformers is not installed", allow_module_level=True)
pytest.importorskip("tokenizers", reason="tokenizers is not installed")
pytest.importorskip("safetensors", reason="safetensors is not installed")

from safetensors.torch import load_file

import nereus_rl

VOCAB = 448  # the word-level tokenizer has 429 tokens
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CHAT = (
    "{% for m in messages %}<user> {{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %} <assistant>{% endif %}"
)
# Short runs on few processes (the 2-core CI machine).
RUN = dict(
    steps=2, batch=4, group_size=2, length_start=6, length_end=6, calibration_probes=0,
    adapt=False, save_every=1,
)  # fmt: skip


def _tokenizer(chat: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rows = [json.loads(line) for line in ARITH_WORD.read_text().splitlines() if line.strip()]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[PAD]", "[UNK]", "[EOS]", "<user>", "<assistant>"]
    tok.train_from_iterator(
        [r["prompt"] + " " + r["answer"] for r in rows],
        trainers.WordLevelTrainer(special_tokens=special),
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    )
    if chat:
        fast.chat_template = CHAT
    return fast


def _build(arch: str, folder: Path) -> Path:
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=5e5, rms_norm_eps=1e-6, **COMMON)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(
            rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, **COMMON
        )
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # biases and norm scales that matter, so a lost one shows
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    _tokenizer(chat=arch == "qwen2").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return {a: _build(a, tmp_path_factory.mktemp(f"hf_{a}")) for a in ("llama", "qwen2")}


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(3))


def _same_logits(folder: Path) -> None:
    """transformers' logits of a saved policy folder equal ours, loaded from it."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = Decoder(hf_config(folder))
    load_hf_weights(ours, folder)
    with torch.no_grad():
        want, got = hf(_ids()).logits, ours(_ids())
    assert torch.allclose(got, want, rtol=0, atol=1e-6 * want.abs().max().item())


def _same_values(folder: Path, config: ModelConfig) -> None:
    """transformers' token-classification values of a saved critic equal our critic's."""
    hf = transformers.AutoModelForTokenClassification.from_pretrained(folder).eval()
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    assert torch.equal(tensors["score.bias"], torch.zeros(1))
    critic = Decoder(config, value_head=True)
    critic.load_shard_state_dict(
        {
            s.name: tensors[
                "score.weight" if s.name == "value_head.weight" else hf_name(s.name, config)
            ]
            for s in state_specs(config, value_head=True)
        }
    )
    with torch.no_grad():
        want, got = hf(_ids()).logits.squeeze(-1), critic(_ids())
    assert torch.allclose(got, want, rtol=0, atol=1e-6 * want.abs().max().item())


def _changed(before: Path, after: Path) -> float:
    a = load_file(before / "model.safetensors")
    b: dict[str, torch.Tensor] = {}
    for f in after.glob("*.safetensors"):
        b.update(load_file(f))
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _reward(prompt: str, response: str, answer: str) -> float:
    # varies with the response, so that training moves the weights
    return float(sum(map(ord, response)) % 3)


# ------------------------------------------------------------------ runs


@pytest.mark.slow
def test_llama_grpo_tp2_saves_the_live_shards(folders, tmp_path):
    from nereus_rl.trainer.report import RunLog
    from nereus_rl.trainer.trainer import TrainConfig, Trainer

    cfg = TrainConfig(
        algo="grpo", model=str(folders["llama"]), data=str(ARITH_WORD), reward_fn=_reward,
        devices=2, plan=simple_plan("grpo", 2, "colocated", tp=2), **RUN,
    )  # fmt: skip
    trainer = Trainer(cfg)
    trainer.log = RunLog(tmp_path / "run", cfg)
    try:
        trainer.start()
        result = trainer.run()
        live = trainer.driver.call(trainer.workers, "rl.shards", "actor_train")
    finally:
        trainer.close()
    assert result.error is None and len(result.metrics) == 2
    assert [s["saved"] for s in result.saves] == ["step-000001", "final"]
    policy = tmp_path / "run" / "policy"
    assert (policy / "tokenizer.json").exists() and (policy / "config.json").exists()
    assert (tmp_path / "run" / "saved" / "step-000001" / "policy" / "model.safetensors").exists()
    assert _changed(folders["llama"], policy) > 0  # the run trained it
    # the saved tensors are the two tp ranks' live shards, joined
    mc = hf_config(policy)
    saved = load_file(policy / "model.safetensors")
    shards = [live[w] for w in trainer.workers]
    for s in state_specs(mc):
        got = saved[hf_name(s.name, mc)]
        want = (
            shards[0][s.name]
            if s.split_dim is None
            else torch.cat([sh[s.name] for sh in shards], s.split_dim)
        )
        assert torch.equal(got, want), s.name
    _same_logits(policy)


@pytest.mark.slow
def test_qwen2_ppo_pp2_saves_policy_and_critic(folders, tmp_path):
    run = tmp_path / "run"
    res = nereus_rl.train(
        algo="ppo", model=folders["qwen2"], data=ARITH_WORD, reward_fn=_reward, devices=2,
        plan=simple_plan("ppo", 2, "colocated", pp=2), run_dir=run, **RUN,
    )  # fmt: skip
    assert res.error is None and len(res.metrics) == 2
    for sub in ("policy", "critic"):
        assert (run / sub / "model.safetensors.index.json").exists()  # a file per stage
        assert (run / "saved" / "step-000001" / sub / "config.json").exists()
    _same_logits(run / "policy")
    _same_values(run / "critic", hf_config(folders["qwen2"]))
    # the tied embedding is stored once
    index = json.loads((run / "policy" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]


@pytest.mark.slow
def test_cli_reward_failing_mid_run_stops_with_the_run_folder(folders, tmp_path, capsys):
    """``--reward file.py:function`` whose function passes the check before training and
    raises on the first real response: the run stops, exit status 1, folder intact."""
    from nereus_rl.cli import main

    rfile = tmp_path / "myreward.py"
    rfile.write_text(
        "def picky(prompt, response, answer):\n"
        "    if response != answer:  # the check passes the answer as the response\n"
        "        raise ZeroDivisionError('no')\n"
        "    return 1.0\n"
    )
    run = tmp_path / "run"
    rc = main([
        "train", "--model", str(folders["llama"]), "--data", str(ARITH_WORD),
        "--reward", f"{rfile}:picky", "--steps", "2", "--devices", "1", "--no-adapt",
        "--batch", "4", "--group-size", "2", "--length", "6", "--run-dir", str(run),
    ])  # fmt: skip
    assert rc == 1
    err = capsys.readouterr().err
    assert "picky" in err and "ZeroDivisionError" in err and "arith_word.jsonl:" in err, err
    assert (run / "config.json").exists() and (run / "metrics.jsonl").exists()
    assert "picky" in (run / "error.txt").read_text()
    assert not (run / "policy").exists()  # a failed run saves nothing


# ------------------------------------------------------------------ bad input


def _train(folder, **kw):
    args = dict(model=folder, data=ARITH_WORD, reward_fn="numeric", devices=1, steps=1)
    args.update(kw)
    return nereus_rl.train(**args)


@pytest.fixture
def tiny_folder(tmp_path) -> Path:
    """A small Llama folder written by our own save (fast), with the test tokenizer."""
    mc = ModelConfig("t", 2, 32, 4, 2, 64, VOCAB, 256, rope_theta=5e5, norm_eps=1e-6)
    folder = tmp_path / "m"
    save_hf(folder, Decoder(mc).shard_state_dict(), mc)
    _tokenizer(chat=False).save_pretrained(folder)
    return folder


def test_missing_config(tiny_folder):
    (tiny_folder / "config.json").unlink()
    with pytest.raises(HFCheckpointError, match=f"{tiny_folder}/config.json: not found"):
        _train(tiny_folder)


def test_malformed_config(tiny_folder):
    (tiny_folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(HFCheckpointError, match=r"config\.json: not valid JSON"):
        _train(tiny_folder)


def test_unsupported_architecture(tiny_folder):
    raw = json.loads((tiny_folder / "config.json").read_text())
    raw["architectures"] = ["MistralForCausalLM"]
    (tiny_folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFCheckpointError, match="MistralForCausalLM"):
        _train(tiny_folder)


def test_weights_that_do_not_match_the_config(tiny_folder):
    raw = json.loads((tiny_folder / "config.json").read_text())
    raw["intermediate_size"] = 96
    (tiny_folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFCheckpointError, match=r"mlp\.gate_proj\.weight in .*model\.safetensors"):
        _train(tiny_folder)


def test_corrupt_weights(tiny_folder):
    (tiny_folder / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(HFCheckpointError, match=r"model\.safetensors: not a readable safetensors"):
        _train(tiny_folder)


def test_no_such_model_folder(tmp_path):
    with pytest.raises(HFCheckpointError, match="no such folder"):
        _train(tmp_path / "nothing")


def test_tokenizer_larger_than_the_vocabulary(tmp_path):
    mc = ModelConfig("t", 2, 32, 4, 2, 64, 256, 256)
    save_hf(tmp_path, Decoder(mc).shard_state_dict(), mc)
    _tokenizer(chat=False).save_pretrained(tmp_path)
    with pytest.raises(
        TokenizerError, match=r"tokenizer has 429 tokens but the model's vocabulary has 256"
    ):
        _train(tmp_path)


def test_no_tokenizer(tiny_folder):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tiny_folder / f).unlink()
    with pytest.raises(TokenizerError, match="no tokenizer there"):
        _train(tiny_folder)


def test_dataset_row_without_the_field(tiny_folder, tmp_path):
    data = tmp_path / "d.jsonl"
    lines = ARITH_WORD.read_text().splitlines()[:3]
    lines[1] = json.dumps({"prompt": "How many?", "solution": "#### 3"})
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=f"{data}:2: no field 'answer'"):
        _train(tiny_folder, data=data)


def test_reward_function_that_raises(tiny_folder):
    def broken(prompt, response, answer):
        raise KeyError("oops")

    with pytest.raises(RewardFnError, match=r"broken.*raised KeyError"):
        _train(tiny_folder, reward_fn=broken)


def test_reward_function_that_returns_a_non_number(tiny_folder):
    def texty(prompt, response, answer):
        return "1.0"

    with pytest.raises(RewardFnError, match=r"texty.*returned str"):
        _train(tiny_folder, reward_fn=texty)


def test_unknown_reward_name(tiny_folder):
    with pytest.raises(RewardFnError, match="'numerik' is not a built-in verifier"):
        _train(tiny_folder, reward_fn="numerik")


def test_a_dataset_needs_a_reward_and_a_folder_needs_a_dataset(tiny_folder):
    with pytest.raises(TrainConfigError, match="data needs reward_fn"):
        _train(tiny_folder, reward_fn=None)
    with pytest.raises(TrainConfigError, match="give it a prompt dataset"):
        _train(tiny_folder, data=None)


def test_prompts_too_long_for_the_model(tiny_folder):
    with pytest.raises(DatasetError, match=r"arith_word\.jsonl:.*exceeds the model's max_seq_len"):
        _train(tiny_folder, length_start=240, length_end=240)


def test_cli_reports_bad_input_before_starting(tiny_folder, capsys):
    from nereus_rl.cli import main

    shutil.rmtree(tiny_folder)
    rc = main(
        ["train", "--model", str(tiny_folder), "--data", str(ARITH_WORD), "--reward", "numeric"]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "no such folder" in err and str(tiny_folder) in err


def test_chat_template_and_padding(folders):
    """The Qwen2 folder's tokenizer has a chat template: prompts are encoded through it,
    left-padded to the batch's longest, with a mask."""
    from nereus_rl.data.prompts import dataset_prompts

    p = dataset_prompts(
        ARITH_WORD, folders["qwen2"], "numeric", vocab=VOCAB, max_seq_len=256, max_response_len=8
    )
    assert p.tokenizer.chat
    rows = list(p.dataset[:3])
    ids, mask = p.encode(rows)
    assert mask is not None and ids.shape == mask.shape
    for i in range(len(rows)):
        n = int(mask[i].sum())
        text = p.tokenizer.tokenizer.decode(ids[i, -n:].tolist())
        assert text == f"<user> {rows[i].prompt[:-1]} ? <assistant>".replace(".", " ."), text
        assert (ids[i, : ids.shape[1] - n] == p.pad_id).all()
    # a response is decoded up to its EOS and scored against the row's answer
    answer = p.tokenizer.tokenizer(rows[0].answer, add_special_tokens=False)["input_ids"]
    resp = torch.tensor([[*answer, p.eos_id, 5, 6]])
    assert p.score(rows[:1], resp).tolist() == [1.0]


@pytest.mark.parametrize("pp", [1, 2])
def test_critic_saved_as_token_classification(tmp_path, pp):
    """A critic's folder (one file per pipeline stage): transformers'
    AutoModelForTokenClassification gives our critic's values."""
    from nereus_rl.models.hf import save_hf_stage
    from nereus_rl.models.parallel import stage_layers

    mc = ModelConfig(
        "c", 2, 32, 4, 2, 64, VOCAB, 256, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True,
        tie_embeddings=True, arch="qwen2",
    )  # fmt: skip
    critic = Decoder(mc, value_head=True, seed=3)
    with torch.no_grad():
        for name, p in critic.named_parameters():
            if name.endswith(".bias") or name.startswith("value_head"):
                p.normal_(0.0, 0.5)
    state = critic.shard_state_dict()
    specs = state_specs(mc, value_head=True)
    for s in range(pp):
        layers = set(stage_layers(mc.num_layers, pp, s))
        mine = {x.name: state[x.name] for x in specs if x.layer in layers}
        save_hf_stage(tmp_path, mine, mc, stage=s, num_stages=pp, value_head=True)
    _same_values(tmp_path, mc)
    with torch.no_grad():  # and they are this critic's
        hf = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path).eval()
        assert torch.allclose(hf(_ids()).logits.squeeze(-1), critic(_ids()), rtol=0, atol=1e-5)


def test_save_every_needs_a_folder(tiny_folder):
    with pytest.raises(TrainConfigError, match="save_every needs save_dir"):
        _train(tiny_folder, save_every=1)


@pytest.mark.slow
def test_a_hugging_face_run_resumes_from_its_checkpoint(folders, tmp_path):
    opts = dict(
        algo="grpo", model=folders["llama"], data=ARITH_WORD, reward_fn=_reward, devices=2,
        plan=simple_plan("grpo", 2, "colocated"), steps=4, batch=4, group_size=2,
        length_start=6, length_end=6, calibration_probes=0, adapt=False,
        snapshot_budget=float("inf"),
    )  # fmt: skip
    whole = nereus_rl.train(checkpoint_every=3, checkpoint_dir=str(tmp_path), **opts)
    resumed = nereus_rl.train(resume=str(tmp_path / "checkpoint.pt"), **opts)
    assert whole.error is None and resumed.error is None, (whole.error, resumed.error)
    (want,) = [(m["reward_mean"], m["loss"], m["kl"]) for m in whole.metrics if m["step"] == 3]
    got = [(m["step"], m["reward_mean"], m["loss"], m["kl"]) for m in resumed.metrics]
    assert got == [(3, *want)]
