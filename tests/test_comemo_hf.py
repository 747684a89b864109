"""CoMemo on transformers' InternVL: the wrapper (exactness at gates 0, RoPE-DHR ids, memory cache, refusals) and the
staged recipe end to end on a tiny random model saved to a temp folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from apps.comemo import CoMemo  # noqa: E402
from apps.comemo.hf import HFCoMemo, dhr_position_ids, memory_layers  # noqa: E402
from core.hf import revert  # noqa: E402
from tests._hf_tiny import INTERNVL_IMAGE, internvl  # noqa: E402

IMG = INTERNVL_IMAGE
WORDS = ["which", "image", "shows", "a", "digit", "red", "blue", "square", "circle", "is", "it", "?", "one", "two",
         "three", "yes", "no", "the", "and", "left", "right"]


def _ids(text_before: int, n_img: int, text_after: int) -> torch.Tensor:
    return torch.tensor([[5] * text_before + [IMG] * n_img + [6] * text_after])


# RoPE-DHR ids with T = 2 tokens per tile side (the tiny model's 4 tokens per tile), written out by hand: a tile token
# takes the id of the thumbnail cell (2 x 2 ids: 0 1 / 2 3) that holds its centre; tiles row-major, then the thumbnail.
HAND = {
    (1, 1): [0, 1, 2, 3],  # one tile, no thumbnail: the tile is the whole image
    (1, 3): [0, 0, 2, 2, 0, 1, 2, 3, 1, 1, 3, 3, 0, 1, 2, 3],
    (2, 2): [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 0, 1, 2, 3],
    (2, 3): [0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 2, 3, 3, 3, 3, 3, 0, 1, 2, 3],
    (3, 2): [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 2, 2, 1, 1, 3, 3, 2, 2, 2, 2, 3, 3, 3, 3, 0, 1, 2, 3],
}


@pytest.mark.parametrize("grid", list(HAND))
def test_dhr_ids_match_hand_written(grid):
    n = len(HAND[grid])
    pos = dhr_position_ids(_ids(2, n, 3), IMG, [[grid]], 2)[0].tolist()
    assert pos == [0, 1] + [2 + v for v in HAND[grid]] + [6, 7, 8]
    if grid[0] > 1 and grid[1] > 1:  # the reference's column-first tile numbering would give other ids here
        rows, cols = grid
        col_first = [HAND[grid][4 * (c * rows + r):4 * (c * rows + r) + 4] for r in range(rows) for c in range(cols)]
        assert sum(col_first, []) + HAND[grid][-4:] != HAND[grid]


def test_dhr_ids_two_images_and_errors():
    ids = torch.tensor([[5, IMG, IMG, IMG, IMG, 6] + [IMG] * 20 + [7]])
    pos = dhr_position_ids(ids, IMG, [[(1, 1), (2, 2)]], 2)[0].tolist()
    assert pos == [0, 1, 2, 3, 4, 5] + [6 + v for v in HAND[(2, 2)]] + [10]
    with pytest.raises(ValueError, match="image tokens"):
        dhr_position_ids(ids, IMG, [[(1, 1)]], 2)
    assert memory_layers(8, 4) == [3, 7] and memory_layers(2, 2) == [1] and memory_layers(2, 1) == [0, 1]
    with pytest.raises(ValueError, match="places no memory block"):
        memory_layers(2, 4)


def _wrapped(every=1, queries="all", gates=None, B=1):
    torch.manual_seed(0)
    model, inputs = internvl(B=B)
    w = HFCoMemo(model, every=every, queries=queries).eval()
    if gates is not None:
        for m in w.memory.values():
            m.block.attn_gate.data.fill_(gates)
            m.block.ff_gate.data.fill_(gates)
    return w, inputs


@pytest.mark.parametrize("queries", ["all", "text"])
def test_gates_at_zero_reproduce_the_model_exactly(queries):
    w, inp = _wrapped(every=1, queries=queries, B=2)
    ids, pv = inp["input_ids"], inp["pixel_values"]
    pos = w.position_ids(ids)
    assert pos[0, 2:6].tolist() == [2, 3, 4, 5] and pos[0, 6] == 6  # one tile: the thumbnail's ids
    with torch.no_grad():
        got = w(ids, pv).logits
        removed = revert(w.model)
        want = w.model(input_ids=ids, pixel_values=pv, position_ids=pos, attention_mask=torch.ones_like(ids)).logits
        plain_1d = w.model(input_ids=ids, pixel_values=pv).logits
    assert set(removed) == {0, 1}
    assert torch.equal(got, want)
    torch.testing.assert_close(plain_1d, want)  # one tile per image: RoPE-DHR ids are the 1-D ids


def test_memory_changes_output_and_queries_option():
    w, inp = _wrapped(every=2, gates=0.5)
    ids, pv = inp["input_ids"], inp["pixel_values"]
    assert w.layers == [1]
    with torch.no_grad():
        a = w(ids, pv).logits
        w.queries = "text"
        b = w(ids, pv).logits
        w.queries = "all"
        for m in w.memory.values():
            m.block.attn_gate.data.zero_()
            m.block.ff_gate.data.zero_()
        c = w(ids, pv).logits
    assert not torch.allclose(a, c) and not torch.allclose(a, b)
    img = (ids[0] == IMG).nonzero().flatten()
    first_img = int(img[0])
    torch.testing.assert_close(b[0, :first_img], a[0, :first_img])  # tokens before any image: same both ways


def test_generation_with_memory_cache_equals_recomputation():
    w, inp = _wrapped(every=1, gates=0.8)
    ids, pv = inp["input_ids"], inp["pixel_values"]
    before = w.state.kv_computations
    cached = w.generate(ids, pv, max_new_tokens=5)
    n_cached = w.state.kv_computations - before
    again = w.generate(ids, pv, max_new_tokens=5, cache_memory=False)
    n_again = w.state.kv_computations - before - n_cached
    assert n_cached == len(w.layers) and n_again == 5 * len(w.layers)  # once per prompt vs once per step
    seq, full = ids, []
    with torch.no_grad():
        for _ in range(5):  # no cache at all: the whole sequence each time, positions from dhr_position_ids
            tok = w(seq, pv).logits[:, -1].argmax(-1)
            full.append(tok)
            seq = torch.cat([seq, tok[:, None]], dim=1)
    assert torch.equal(cached, again) and torch.equal(cached, torch.stack(full, dim=1))


def test_wrong_folder_kinds_are_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests._hf_tiny import LLM

    LlamaForCausalLM(LlamaConfig(**LLM)).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="needs an InternVL-family model"):
        CoMemo.from_hf(tmp_path / "llama")
    with pytest.raises(ValueError, match="needs an InternVL-family model"):
        HFCoMemo(LlamaForCausalLM(LlamaConfig(**LLM)))
    with pytest.raises(FileNotFoundError):
        CoMemo.from_hf(tmp_path / "missing")
    with pytest.raises(ValueError, match="hub id"):
        CoMemo.from_hf("OpenGVLab/InternVL3-1B-hf")


# -- the recipe, end to end ----------------------------------------------------------------------------------------

def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: 10 + i for i, w in enumerate(WORDS)},
             "<IMG_CONTEXT>": IMG, "<img>": IMG + 1, "</img>": IMG + 2}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", additional_special_tokens=["<IMG_CONTEXT>", "<img>", "</img>"])


def _tiny_folders(tmp_path):
    from PIL import Image

    model, _ = internvl()
    model.config.eos_token_id = 2
    model.save_pretrained(tmp_path / "model")
    _tiny_tokenizer().save_pretrained(tmp_path / "model")
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i, (w, h) in enumerate([(28, 28), (84, 28), (56, 56), (28, 28)]):  # 1x1, 1x3 + thumb, 2x2 + thumb, 1x1
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(data / f"im{i}.png")
    for k in range(3):
        imgs = [f"im{(k + j) % 4}.png" for j in range(2)]
        rows.append({"images": imgs, "question": "which image shows a digit ?", "answer": ["one", "two"][k % 2]})
    (data / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "model", data


def test_recipe_runs_three_stages_and_resumes(tmp_path):
    from safetensors.torch import load_file

    from apps.comemo.recipes.internvl import main

    model_dir, data = _tiny_folders(tmp_path)
    common = ["--data", str(data), "--every", "2", "--max-tiles", "4", "--device", "cpu", "--lr", "1e-2",
              "--warmup", "1", "--threads", "1"]
    s1, s2, s3 = (tmp_path / f"s{k}" for k in (1, 2, 3))
    assert main(["--model", str(model_dir), "--out", str(s1), "--stage", "1", "--steps", "3", *common]) == 0
    mem1 = load_file(s1 / "comemo_memory.safetensors")
    assert float(mem1["1.attn_gate"]) != 0.0  # stage 1 trains the gates
    base0, base1 = load_file(model_dir / "model.safetensors"), load_file(s1 / "model.safetensors")
    llm = [k for k in base0 if "language_model" in k and ".layers." in k]
    assert llm and all(torch.equal(base0[k], base1[k]) for k in llm)  # LLM frozen
    proj = [k for k in base0 if "multi_modal_projector" in k]
    assert any(not torch.equal(base0[k], base1[k]) for k in proj)  # projector trained
    assert main(["--model", str(s1), "--out", str(s2), "--stage", "2", "--steps", "2", *common]) == 0
    mem2, base2 = load_file(s2 / "comemo_memory.safetensors"), load_file(s2 / "model.safetensors")
    assert torch.equal(mem1["1.attn_gate"], mem2["1.attn_gate"])  # stage 2: gates frozen
    assert not torch.equal(mem1["1.attn.q_proj.weight"], mem2["1.attn.q_proj.weight"])
    vis = [k for k in base0 if "vision_tower" in k]
    assert all(torch.equal(base1[k], base2[k]) for k in vis + llm)  # LLM and ViT frozen
    # stage 3, 4 steps at once vs 2, then resumed to 4: the same weights
    assert main(["--model", str(s2), "--out", str(s3), "--stage", "3", "--steps", "4", *common]) == 0
    part = tmp_path / "s3_part"
    assert main(["--model", str(s2), "--out", str(part), "--stage", "3", "--steps", "4", "--stop-at", "2",
                 *common]) == 0
    assert main(["--model", str(s2), "--out", str(part), "--stage", "3", "--steps", "4", "--resume", *common]) == 0
    a, b = load_file(s3 / "model.safetensors"), load_file(part / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(base2[k], a[k]) for k in llm)  # stage 3 trains the LLM
    back = CoMemo.from_hf(s3, device="cpu")  # the trained memory comes back with the model
    assert back.every == 2 and back.gates() and any(v != 0 for v in back.gates().values())
    rows = [json.loads(x) for x in (s3 / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) for r in rows)


@pytest.mark.slow
def test_recipe_under_torchrun_ddp_and_fsdp_agree(tmp_path):
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    model_dir, data = _tiny_folders(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "apps.comemo.recipes.internvl",
               "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / name), "--stage", "3", "--steps",
               "2", "--every", "2", "--max-tiles", "4", "--device", "cpu", "--threads", "1", *extra]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    for f in ("model.safetensors", "comemo_memory.safetensors"):
        a, b = load_file(tmp_path / "ddp" / f), load_file(tmp_path / "fsdp" / f)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    base, trained = load_file(model_dir / "model.safetensors"), load_file(tmp_path / "ddp" / "model.safetensors")
    assert any(not torch.equal(base[k], trained[k]) for k in base if "language_model" in k)


# -- the memory block's architecture switches and the grids a tiled image needs ------------------------------------

def test_a_tiled_image_without_grids_is_refused_not_made_1d():
    w, _ = _wrapped(every=2)
    tiled = _ids(2, 5 * 4, 3)  # 2x2 tiles + thumbnail of 4 tokens each, in one run
    with pytest.raises(ValueError, match="image_grids"):
        w.position_ids(tiled)
    assert w.position_ids(tiled, [[(2, 2)]])[0, 2:22].tolist() == [2 + v for v in HAND[(2, 2)]]
    two_single = torch.tensor([[5, IMG, IMG, IMG, IMG, 6, IMG, IMG, IMG, IMG, 7]])  # separated single tiles: fine
    assert w.position_ids(two_single)[0].tolist() == list(range(11))
    w.positions = "1d"  # 1-D positions need no grid
    assert w.position_ids(tiled)[0].tolist() == list(range(tiled.shape[1]))


def test_memory_config_switches_build_the_release_layout():
    from apps.comemo.hf_config import MemoryConfig

    torch.manual_seed(0)
    model, inp = internvl()
    rel = MemoryConfig.release(every=2, num_heads=4, head_dim=8, ffn_hidden=48)
    w = HFCoMemo(model, config=rel)
    blk = w.memory["1"].block
    assert blk.attn.num_kv_heads == 4 and blk.attn.head_dim == 8 and tuple(blk.attn.k_proj.weight.shape) == (32, 64)
    assert blk.mlp.activation == "swiglu" and tuple(blk.mlp.fc1.weight.shape) == (96, 64)
    assert blk.norm1.eps == 1e-5 and w.memory_rope is not None and w.memory_rope.base == 1e6
    assert not rel.reference and rel.with_reference(True).reference
    assert w.memory_config()["kv_heads"] == "full"
    with pytest.raises(ValueError, match="kv_heads"):
        MemoryConfig(kv_heads="half")
    with pytest.raises(ValueError, match="every"):
        MemoryConfig(every=0)
    # a memory file written before these switches existed reads as the project's layout
    old = MemoryConfig.from_dict({"every": 2, "queries": "text", "positions": "1d", "layers": [1], "mlp_hidden_dim": 32})
    assert (old.every, old.queries, old.ffn_hidden, old.kv_heads, old.ffn, old.rope_base) == (2, "text", 32, "grouped",
                                                                                            "silu", None)


def test_plain_rope_equals_the_language_models_at_its_base():
    """The memory's own RoPE (the release's fixed base) computes the tables the language model's rotary embedding
    computes at that base: bit for bit, so the two paths cannot drift."""
    from apps.comemo.hf import PlainRope

    w, inp = _wrapped(every=2)
    lm_rope = w.language_model.rotary_emb
    base = float(w.model.config.text_config.rope_parameters["rope_theta"])
    pos = torch.tensor([[0, 5, 17, 400, 3999]])
    x = torch.zeros(1, 5, 64)
    mine, theirs = PlainRope(16, base)(x, pos), lm_rope(x, pos)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])


def test_recipe_reads_the_architecture_from_the_previous_stage_and_uses_the_release_lr(tmp_path, capsys):
    from apps.comemo.recipes.internvl import STAGE_LR, main
    from core.infra.cli import run_cli

    model_dir, data = _tiny_folders(tmp_path)
    common = ["--data", str(data), "--max-tiles", "4", "--device", "cpu", "--warmup", "1", "--threads", "1",
              "--no-progress"]
    s1 = tmp_path / "s1"
    assert main(["--model", str(model_dir), "--out", str(s1), "--stage", "1", "--steps", "1", "--every", "2",
                 *common]) == 0
    capsys.readouterr()
    code = run_cli(main, ["--model", str(s1), "--out", str(tmp_path / "bad"), "--stage", "3", "--steps", "1",
                          "--every", "4", *common])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--every 4" in err and err.count("\n") == 0
    s3 = tmp_path / "s3"
    assert main(["--model", str(s1), "--out", str(s3), "--stage", "3", "--steps", "1", *common]) == 0  # no --every
    row = json.loads((s3 / "metrics.jsonl").read_text().splitlines()[0])
    assert STAGE_LR == {1: 1e-4, 2: 1e-4, 3: 4e-5} and row["lr"] == pytest.approx(STAGE_LR[3])
    assert CoMemo.from_hf(s3, device="cpu").every == 2
    from apps.comemo.predict import main as predict  # a trained stage folder answers through the predict CLI

    capsys.readouterr()
    code = run_cli(predict, ["--model", str(s3), "--images", str(data / "im1.png"), "--question", "which image ?",
                             "--max-new-tokens", "2", "--device", "cpu"])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    code = run_cli(main, ["--model", str(s1), "--out", str(tmp_path / "gpu"), "--stage", "3", "--steps", "1",
                          "--data", str(data), "--device", "cuda"])
    err = capsys.readouterr().err.strip()
    if not torch.cuda.is_available():
        assert code == 2 and "no CUDA GPU" in err and err.count("\n") == 0


def test_recipe_trains_on_the_prompt_inference_builds(tmp_path):
    """A folder with a chat template: the recipe's sample is the answer prompt + the answer and end of turn."""
    from apps.comemo.recipes.internvl import encode_sample

    model_dir, data = _tiny_folders(tmp_path)
    tok = _tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] + ' ' + m['content'] + ' </s> ' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'assistant ' }}{% endif %}")
    tok.save_pretrained(model_dir)
    w = CoMemo.from_hf(model_dir, device="cpu", every=2)
    sample = json.loads((data / "data.jsonl").read_text().splitlines()[0])
    enc = encode_sample(sample, data, w, max_tiles=4, model_folder=model_dir)
    prompt = w.prompt([data / im for im in sample["images"]], sample["question"], max_tiles=4)
    n = prompt.input_ids.shape[1]
    assert torch.equal(enc["input_ids"][:, :n], prompt.input_ids) and enc["image_grids"] == prompt.image_grids
    answer_ids = enc["input_ids"][0, n:].tolist()
    assert (enc["labels"][0, :n] == -100).all() and enc["labels"][0, n:].tolist() == answer_ids
    assert answer_ids == tok(sample["answer"] + " </s> ", add_special_tokens=False)["input_ids"]
