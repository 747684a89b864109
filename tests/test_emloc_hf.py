"""apps.emloc on a real architecture: a tiny random Qwen2-VL with an offline processor (tests/_emloc_hf_tiny.py).

``full`` against the model's own forward on the uncompressed prompt; every budgeted policy at its exact budget;
EMLoC's JS bound per chunk by an independent replay of each chunk; save / reload / refusal for another model; bad
images refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from apps.emloc import HFContext, compress_hf  # noqa: E402
from apps.emloc.hf_inputs import demo_pieces, embed, load_image, suffix_pieces  # noqa: E402
from core.kv_compress import pyramid_budgets  # noqa: E402
from tests import _hf_tiny as T  # noqa: E402

# --- a tiny random Qwen2-VL (tests/_hf_tiny.py family "qwen2-vl") with a processor built offline: a word-level
# tokenizer whose special tokens carry the model's ids, Qwen2-VL's chat-template format and image processor
# (56x56 to 112x112 pixels: 4 to 16 image tokens) ---

TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = {"<unk>": 0, "<s>": 1, "<|im_end|>": 2, "<|im_start|>": 3, "<|image_pad|>": T.QWEN2VL_IMAGE,
           "<|video_pad|>": 151, "<|vision_start|>": 152, "<|vision_end|>": 153}
WORDS = ("system user assistant you are a helpful what is in the image this class cat dog bird fish tree car boat "
         "plane house horse zero one two three four five six seven eight nine answer label ?").split()
CLASSES = ("cat", "dog", "bird", "fish", "tree", "car", "boat", "plane")


def tiny_processor():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen2VLProcessor

    vocab = dict(SPECIAL)
    free = [i for i in range(T.VOCAB) if i not in SPECIAL.values()]
    vocab.update({w: i for w, i in zip(dict.fromkeys(WORDS), free)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL if t != "<unk>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>", eos_token="<|im_end|>",
                                   bos_token="<s>", extra_special_tokens={"image_token": "<|image_pad|>",
                                                                          "video_token": "<|video_pad|>"})
    image = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    try:
        from transformers import Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor()
    except Exception:  # noqa: BLE001 - the video processor needs torchvision; images do not
        video = None
    return Qwen2VLProcessor(image_processor=image, tokenizer=fast, video_processor=video, chat_template=TEMPLATE)


def tiny_model():
    m, _ = T.qwen2_vl()
    return m


def tiny_qwen25_vl():
    """Qwen2.5-VL of the same sizes (window attention in the vision tower, one full-attention block) and its
    processor (the same tokenizer, template and image processor)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text = {**T.LLM, "bos_token_id": 1, "eos_token_id": 2, "rope_parameters": rope}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=56, fullatt_block_indexes=[1])
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=T.QWEN2VL_IMAGE, video_token_id=151,
                           vision_start_token_id=152, vision_end_token_id=153)  # fmt: skip
    model = T._finish(Qwen2_5_VLForConditionalGeneration(cfg))
    p = tiny_processor()
    return model, Qwen2_5_VLProcessor(image_processor=p.image_processor, tokenizer=p.tokenizer,
                                      video_processor=p.video_processor, chat_template=p.chat_template)


def tiny_internvl():
    """InternVL (tests/_hf_tiny.py family "internvl": 28x28 images, 4 image tokens, a Qwen2 LM with 1-D RoPE) and a
    processor: the same word-level vocabulary with InternVL's image tokens at the model's ids."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, PreTrainedTokenizerFast

    special = {"<unk>": 0, "<s>": 1, "<|im_end|>": 2, "<|im_start|>": 3, "<IMG_CONTEXT>": T.INTERNVL_IMAGE,
               "<video>": 151, "<img>": 152, "</img>": 153}
    vocab = dict(special)
    vocab.update({w: i for w, i in zip(dict.fromkeys(WORDS), [i for i in range(T.VOCAB) if i not in special.values()])})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special if t != "<unk>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>", eos_token="<|im_end|>",
                                   bos_token="<s>", extra_special_tokens={
                                       "start_image_token": "<img>", "end_image_token": "</img>",
                                       "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"})
    template = TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<IMG_CONTEXT>\n")
    try:
        from transformers import InternVLVideoProcessor

        video = InternVLVideoProcessor()
    except Exception:  # noqa: BLE001 - the video processor needs torchvision; images do not
        video = None
    proc = InternVLProcessor(image_processor=GotOcr2ImageProcessor(size={"height": 28, "width": 28}, crop_to_patches=False),
                             tokenizer=fast, video_processor=video, image_seq_length=4, chat_template=template)
    return T.internvl()[0], proc


def tiny_llava_onevision():
    """LLaVA-OneVision (a 2-layer SigLIP tower at 28x28, one grid pinpoint, a Qwen2 LM with 1-D RoPE) and its
    processor: the word-level vocabulary with ``<image>`` at the model's id, the same chat template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                              LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor,
                              PreTrainedTokenizerFast)  # fmt: skip

    special = {"<unk>": 0, "<s>": 1, "<|im_end|>": 2, "<|im_start|>": 3, "<image>": 150, "<video>": 151}
    vocab = dict(special)
    vocab.update({w: i for w, i in zip(dict.fromkeys(WORDS), [i for i in range(T.VOCAB) if i not in special.values()])})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special if t != "<unk>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>", eos_token="<|im_end|>",
                                   bos_token="<s>", extra_special_tokens={"image_token": "<image>", "video_token": "<video>"})
    side = {"height": 28, "width": 28}
    image = LlavaOnevisionImageProcessor(size=side, crop_size=side, image_grid_pinpoints=[[28, 28]], do_pad=True)
    proc = LlavaOnevisionProcessor(image_processor=image, tokenizer=fast, video_processor=LlavaOnevisionVideoProcessor(),
                                   chat_template=TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>\n"),
                                   num_image_tokens=4, vision_feature_select_strategy="full")  # fmt: skip
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    cfg = LlavaOnevisionConfig(vision_config=vision, text_config=dict(model_type="qwen2", **T.LLM), image_token_id=150,
                               video_token_id=151, vision_feature_select_strategy="full", vision_feature_layer=-1,
                               image_grid_pinpoints=[[28, 28]])  # fmt: skip
    return T._finish(LlavaOnevisionForConditionalGeneration(cfg)), proc


def tiny_images(n: int, seed: int = 0, size: int = 56) -> list[np.ndarray]:
    """``n`` random RGB images (size x size, uint8)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]


def tiny_demos(n: int, seed: int = 0, n_way: int = 3) -> list[tuple[np.ndarray, str]]:
    rng = np.random.default_rng(seed + 1)
    return [(img, CLASSES[int(rng.integers(n_way))]) for img in tiny_images(n, seed)]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    return tiny_model(), tiny_processor(), tiny_demos(10, seed=0)


@pytest.fixture(scope="module")
def setup25():
    torch.manual_seed(0)
    return (*tiny_qwen25_vl(), tiny_demos(9, seed=4))


@pytest.fixture(scope="module")
def setup_internvl():
    torch.manual_seed(0)
    return (*tiny_internvl(), tiny_demos(9, seed=5))


@pytest.fixture(scope="module")
def setup_llava_ov():
    torch.manual_seed(0)
    return (*tiny_llava_onevision(), tiny_demos(9, seed=6))


@pytest.fixture(params=["qwen2-vl", "qwen2.5-vl", "internvl", "llava-onevision"])
def family(request, setup, setup25, setup_internvl, setup_llava_ov):
    return {"qwen2-vl": setup, "qwen2.5-vl": setup25, "internvl": setup_internvl,
            "llava-onevision": setup_llava_ov}[request.param]


def test_full_reproduces_the_models_own_logits_on_the_uncompressed_prompt(family):
    """The query's logits after a ``full`` memory equal one forward of the whole prompt (demonstrations + query,
    rendered by the chat template, positions by the model itself) under transformers' own eager attention."""
    model, proc, demos = family
    query = tiny_images(1, seed=7)[0]
    turns = []
    for _, label in demos:
        turns += [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": label}]}]
    turns.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]})
    text = proc.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    imgs = [load_image(d[0], "d") for d in demos] + [load_image(query, "q")]
    inputs = proc(text=[text], images=imgs, return_tensors="pt")
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(**inputs).logits[0].float()
    ctx = compress_hf(model, demos, processor=proc, policy="full")
    assert model.config._attn_implementation == "longctx"
    ours = ctx.query_logits(query)
    assert ctx.num_tokens + ours.shape[0] == inputs["input_ids"].shape[1]  # the same tokens, split at the query
    torch.testing.assert_close(ours, ref[-ours.shape[0]:], atol=1e-6, rtol=0)  # measured: 2e-7 (logits ~0.6)
    assert ctx.keep_fraction() == 1.0
    # the cache is left as it was: a second query gives the same numbers
    torch.testing.assert_close(ctx.query_logits(query), ours, atol=0, rtol=0)


@pytest.mark.parametrize("policy", ["random", "streaming", "h2o", "snapkv", "pyramidkv", "fastv"])
def test_every_budgeted_policy_keeps_exactly_its_budget(setup, policy):
    model, proc, demos = setup
    keep = 0.9 if policy == "fastv" else 0.3  # FastV keeps every text token; these demos are mostly text
    ctx = compress_hf(model, demos, processor=proc, policy=policy, keep=keep, window=8, seed=1)
    budget = int(round(keep * ctx.num_tokens))
    assert ctx.settings["budget"] == budget
    counts = [c.flatten() for c in ctx.kept_counts()]  # per layer, per KV head
    L = len(counts)
    if policy == "pyramidkv":
        want = pyramid_budgets(budget, L, floor=8)
        assert [int(c[0]) for c in counts] == want and sum(want) == budget * L
    elif policy == "fastv":  # layers below k_layer = min(2, depth - 1) = 1 whole
        assert int(counts[0][0]) == ctx.num_tokens and all(int(v) == budget for v in counts[1])
    else:
        assert all(int(v) == budget for c in counts for v in c)
    scores = ctx.label_scores(tiny_images(1, seed=3)[0], ["cat", "dog", "bird"])
    assert scores.shape == (3,) and torch.isfinite(scores).all()


def _js(p, q):
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    m = torch.log((lp.exp() + lq.exp()) / 2)
    return 0.5 * ((lp.exp() * (lp - m)).sum(-1) + (lq.exp() * (lq - m)).sum(-1))


@pytest.mark.parametrize("delta", [0.005, 1e-5])
def test_js_bound_holds_on_every_chunk_by_an_independent_replay(family, delta):
    """Rebuild each chunk's situation from the final memory (the memory before it, its kept tokens), re-prefill
    the chunk whole after that memory, re-encode each of its demonstrations as a suffix against both, and check
    the mean JS at the observed positions is at most delta."""
    from core.hf import mrope_position_ids, prefill, prune_cache

    model, proc, demos = family
    ctx = compress_hf(model, demos, processor=proc, delta=delta, chunk_demos=4)
    assert len(ctx.reports) == math.ceil(len(demos) / 4)
    imgs = [load_image(d[0], "d") for d in demos]
    pieces = demo_pieces(model, proc, imgs, [d[1] for d in demos])
    # observers: each demonstration as it follows other turns (the first one without the template's header)
    observers = suffix_pieces(model, proc, imgs[:1], [demos[0][1]]) + pieces[1:]
    assert observers[0].input_ids.numel() < pieces[0].input_ids.numel()
    checked = 0
    for c, rep in enumerate(ctx.reports):
        chunk = pieces[4 * c : 4 * c + 4]
        mrope = hasattr(getattr(model, "model", model), "get_rope_index")  # Qwen2-VL family; else 1-D RoPE
        own = [mrope_position_ids(model, p.input_ids[None], image_grid_thw=p.mm["image_grid_thw"])[0] if mrope
               else torch.arange(p.input_ids.numel())[None] for p in chunk]
        pos, nxt = [], rep.offset
        for o in own:
            pos.append(o + nxt)
            nxt = int((o + nxt).max()) + 1
        assert nxt == rep.next_position
        with torch.no_grad():
            memory = prune_cache(ctx.cache, [torch.arange(m) for m in rep.memory])
            whole = prefill(model, inputs_embeds=torch.cat([embed(model, p) for p in chunk], 1),
                            position_ids=torch.cat(pos, -1), cache=memory).past_key_values
            kept = prune_cache(ctx.cache, [torch.arange(m + k) for m, k in zip(rep.memory, rep.kept)])
            js = []
            for p in observers[4 * c : 4 * c + 4]:
                o = (mrope_position_ids(model, p.input_ids[None], image_grid_thw=p.mm["image_grid_thw"])[0] if mrope
                     else torch.arange(p.input_ids.numel())[None])
                outs = []
                for cache in (whole, kept):
                    trial = prune_cache(cache, [torch.arange(l.keys.shape[2]) for l in cache.layers])  # a copy
                    lg = prefill(model, inputs_embeds=embed(model, p), position_ids=o + nxt, cache=trial).logits[0]
                    outs.append(lg[p.observe])
                js.append(_js(*outs))
        mean_js = float(torch.cat(js).mean())
        assert mean_js <= delta + 1e-9, (c, mean_js, rep)
        assert abs(mean_js - rep.js[0]) < 1e-6  # the report's final value is the one replayed
        checked += 1
    assert checked == len(ctx.reports)
    ratios = {r for rep in ctx.reports for r in rep.ratios}
    if delta == 0.005:
        assert ratios & {0.1, 0.2, 0.5}  # something was pruned
        assert ctx.keep_fraction() < 0.6
    else:
        assert 1.0 in ratios  # a bound that bites: some layer stays whole


def test_answer_tokens_are_always_kept_and_positions_continue(setup):
    model, proc, demos = setup
    ctx = compress_hf(model, demos, processor=proc, delta=0.5, ratios=(0.1,), chunk_demos=5)
    n_ans = sum(int(p.answer.sum()) for p in demo_pieces(model, proc, [load_image(d[0], "d") for d in demos],
                                                             [d[1] for d in demos]))
    for rep in ctx.reports:
        assert all(k >= 1 for k in rep.kept)
    assert min(int(c.min()) for c in ctx.kept_counts()) >= n_ans
    full = compress_hf(model, demos, processor=proc, policy="full")
    assert ctx.next_position == full.next_position  # queries start after the uncompressed maximum


def test_saved_memory_reloads_identically_and_is_refused_for_another_model(setup, tmp_path):
    from core.hf import CacheMismatchError

    model, proc, demos = setup
    ctx = compress_hf(model, demos, processor=proc, delta=0.005)
    path = tmp_path / "memory.safetensors"
    ctx.save(path)
    back = HFContext.load(path, model, proc)
    q = tiny_images(2, seed=5)
    for img in q:
        assert torch.equal(back.label_scores(img, ["cat", "dog"]), ctx.label_scores(img, ["cat", "dog"]))
    assert back.keep_ratios() == ctx.keep_ratios() and back.settings == ctx.settings
    assert [r.kept for r in back.reports] == [r.kept for r in ctx.reports]
    torch.manual_seed(123)
    other = tiny_model()
    with pytest.raises(CacheMismatchError, match="another model"):
        HFContext.load(path, other, proc)
    plain = tmp_path / "plain.safetensors"
    from core.hf import save_cache

    save_cache(ctx.cache, plain, model)
    with pytest.raises(ValueError, match="not an EMLoC memory"):
        HFContext.load(plain, model, proc)


def test_images_of_other_sizes_and_bad_files_are_refused(setup, tmp_path):
    model, proc, demos = setup
    mixed = [(tiny_images(1, seed=1, size=56)[0], "cat"), (tiny_images(1, seed=2, size=84)[0], "dog")]
    with pytest.raises(ValueError, match="one size"):
        compress_hf(model, mixed, processor=proc, policy="full")
    ctx = compress_hf(model, mixed, processor=proc, policy="full", image_size=(56, 56))  # resized: accepted
    assert ctx.settings["image_size"] == [56, 56]
    small = compress_hf(model, demos[:3], processor=proc, policy="full")
    with pytest.raises(ValueError, match="84x84.*56x56"):
        small.predict(tiny_images(1, seed=4, size=84)[0])
    bad = tmp_path / "bad.png"
    bad.write_text("not an image")
    with pytest.raises(ValueError, match="bad.png"):
        compress_hf(model, [(str(bad), "cat"), demos[0]], processor=proc, policy="full")
    with pytest.raises(FileNotFoundError):
        compress_hf(model, [(str(tmp_path / "missing.png"), "cat")], processor=proc, policy="full")
    with pytest.raises(ValueError, match="label text"):
        compress_hf(model, [(demos[0][0], "")], processor=proc, policy="full")
    with pytest.raises(ValueError, match=r"uint8"):
        compress_hf(model, [(torch.rand(56, 56, 3), "cat")], processor=proc, policy="full")
    with pytest.raises(ValueError, match="needs keep"):
        compress_hf(model, demos, processor=proc, policy="snapkv")
    with pytest.raises(ValueError, match="processor"):
        compress_hf(model, demos, policy="full")


# --- the recipe ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny model and processor saved as a model folder; a class-folder dataset and a CSV of the same images."""
    from PIL import Image

    root = tmp_path_factory.mktemp("emloc_recipe")
    torch.manual_seed(0)
    tiny_model().save_pretrained(root / "model")
    tiny_processor().save_pretrained(root / "model")
    rows = ["image,label,split"]
    for c, name in enumerate(["cat", "dog", "bird"]):
        (root / "data" / name).mkdir(parents=True)
        for i, arr in enumerate(tiny_images(5, seed=10 * c, size=60)):
            Image.fromarray(arr).save(root / "data" / name / f"{i}.png")
            rows.append(f"data/{name}/{i}.png,{name},{'train' if i < 4 else 'test'}")
    (root / "data.csv").write_text("\n".join(rows) + "\n")
    return root


def test_recipe_runs_end_to_end_on_a_saved_tiny_model(saved, capsys):
    import json

    from apps.emloc.recipes.qwen2vl import main

    out = saved / "out"
    assert main(["--model", str(saved / "model"), "--data", str(saved / "data"), "--out", str(out), "--demos", "6",
                 "--queries", "1", "--image-size", "56,56", "--compare", "full,snapkv", "--save-memory",
                 "--device", "cpu", "--dtype", "float32"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [r["policy"] for r in res["results"]] == ["emloc", "full", "snapkv"]
    assert res["queries"] == 3 and res["demos"] == 6 and res["classes"] == ["bird", "cat", "dog"]
    em, full, snap = res["results"]
    assert full["kept_fraction"] == 1.0 and em["kept_fraction"] < 1.0
    assert abs(snap["kept_fraction"] - em["kept_fraction"]) < 0.02  # equal budget, up to rounding
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in res["results"])
    assert (out / "memory.safetensors").is_file()
    lines = [json.loads(l) for l in capsys.readouterr().out.strip().splitlines()]
    assert [l["policy"] for l in lines] == ["emloc", "full", "snapkv"]
    out2 = saved / "out_csv"
    assert main(["--model", str(saved / "model"), "--data", str(saved / "data.csv"), "--out", str(out2), "--demos", "5",
                 "--image-size", "56,56", "--policy", "h2o", "--keep", "0.5", "--device", "cpu"]) == 0
    res = json.loads((out2 / "results.json").read_text())
    assert res["queries"] == 3 and res["results"][0]["policy"] == "h2o"


@pytest.mark.parametrize("extra, match", [
    (["--data", "data.csv", "--demos", "99"], "exceeds"),
    (["--image-size", "5,5"], "at least 28"),
    (["--compare", "nope"], "unknown policies"),
    (["--policy", "snapkv"], "needs --keep"),
    (["--n-way", "9"], "exceeds"),
])
def test_recipe_refuses_bad_input_in_one_line(saved, extra, match, capsys):
    from apps.emloc.recipes.qwen2vl import main
    from core.infra.cli import run_cli

    argv = ["--model", str(saved / "model"), "--data", str(saved / "data"), "--out", str(saved / "bad"), "--demos", "4",
            "--queries", "1"]
    argv += [str(saved / e) if e == "data.csv" else e for e in extra]
    assert run_cli(main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and match in err[0]
    assert not (saved / "bad").exists()


def test_label_scores_are_the_models_own_log_probabilities_of_the_answer(setup):
    """With ``full``, a label's score is the log-probability the model gives the answer turn's tokens (the label and
    ``<|im_end|>``) after the whole rendered prompt."""
    model, proc, demos = setup
    query = tiny_images(1, seed=8)[0]
    ctx = compress_hf(model, demos[:5], processor=proc, policy="full")
    turns = []
    for _, label in demos[:5]:
        turns += [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": label}]}]
    imgs = [load_image(d[0], "d") for d in demos[:5]] + [load_image(query, "q")]
    got = ctx.label_scores(query, ["cat", "dog", "bird"])
    for label, score in zip(["cat", "dog", "bird"], got):
        conv = turns + [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": label}]}]
        inputs = proc(text=[proc.apply_chat_template(conv, tokenize=False)], images=imgs, return_tensors="pt")
        ids = inputs["input_ids"][0]
        with torch.no_grad():
            lp = torch.log_softmax(model(**inputs).logits[0].float(), -1)
        assert int(ids[-1]) == 2 and len(tiny_processor().tokenizer("cat")["input_ids"]) == 1  # ... cat <|im_end|>
        want = sum(float(lp[t - 1, ids[t]]) for t in range(ids.numel() - 2, ids.numel()))  # ("\n" has no token here)
        assert abs(float(score) - want) < 1e-4, (label, float(score), want)
    assert ctx.predict(query, ["cat", "dog", "bird"]) == ["cat", "dog", "bird"][int(got.argmax())]


def test_recipe_memory_answers_from_the_predict_cli(saved, capsys):
    """``apps.emloc.predict --memory OUT/memory.safetensors --model DIR`` answers with the recipe's saved memory: the
    same label and scores as ``HFContext.load(...).label_scores``; a bad image is named and the rest answered."""
    import json

    from apps.emloc.cli import predict_main
    from apps.emloc.recipes.qwen2vl import main
    from core.hf import load
    from core.infra.cli import run_cli

    out = saved / "out_predict"
    assert main(["--model", str(saved / "model"), "--data", str(saved / "data"), "--out", str(out), "--demos", "6",
                 "--queries", "1", "--image-size", "56,56", "--save-memory", "--device", "cpu"]) == 0
    capsys.readouterr()
    images = [saved / "data" / "cat" / "4.png", saved / "data" / "dog" / "4.png"]
    bad = saved / "not_an_image.png"
    bad.write_text("no")
    code = run_cli(predict_main, ["--memory", str(out / "memory.safetensors"), "--model", str(saved / "model"),
                                  "--images", *map(str, images), str(bad), "--device", "cpu"])
    cap = capsys.readouterr()
    assert code == 1 and "not_an_image.png" in cap.err
    lines = [json.loads(l) for l in cap.out.strip().splitlines()]
    assert [l["image"] for l in lines] == [str(p) for p in images]
    model, proc = load(saved / "model", dtype="float32", device="cpu")
    ctx = HFContext.load(out / "memory.safetensors", model, proc)
    for line, img in zip(lines, images):
        want = torch.softmax(ctx.label_scores(img), -1)
        assert line["label"] == ctx.labels[int(want.argmax())]
        assert line["scores"] == {l: round(float(v), 4) for l, v in zip(ctx.labels, want)}


def test_a_transformers_folder_points_compress_to_the_recipe_and_memories_to_their_model(saved, tmp_path, capsys):
    from apps.emloc.cli import compress_main, predict_main
    from core.infra.cli import run_cli

    assert run_cli(compress_main, ["--demos", str(saved / "data"), "--out", str(tmp_path / "m.safetensors"),
                                   "--model", str(saved / "model")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "apps.emloc.recipes.qwen2vl" in err[0] and "apps.emloc.predict" in err[0]
    assert not (tmp_path / "m.safetensors").exists()
    from core.hf import load

    model, proc = load(saved / "model", dtype="float32", device="cpu")
    memory = tmp_path / "hf_memory.safetensors"
    compress_hf(model, [(saved / "data" / "cat" / "0.png", "cat")], processor=proc, policy="full").save(memory)
    capsys.readouterr()
    assert run_cli(predict_main, ["--memory", str(memory), "--images", str(saved / "data" / "cat" / "0.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model DIR" in err[0]
