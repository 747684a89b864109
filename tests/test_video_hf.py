"""∞-Video on a real transformers Q-former video-LLM (tiny random InstructBLIP-Video and BLIP-2 Q-former)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("decord")

from tests import _hf_tiny as T  # noqa: E402

# -- a tiny random InstructBLIP-Video saved with its processor -------------------------------------------------------
# Tokenizers are trained on a few sentences. Weights are redrawn at unit scale: at the library's initialisation the tiny
# vision tower's output is almost constant per token and the Q-former's cross-attention context is ~1e-8, too small
# for any read-out to show.
SENTENCES = ["what colour is the square", "how many times does the red square flash", "a red blue green video",
             "what happens after the door opens", "yes no one two three"]  # fmt: skip


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES * 4, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<pad>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")  # fmt: skip


def save_tiny_instructblip_video(folder: Path, seed: int = 0) -> Path:
    """Model + processor in ``folder`` (28x28 frames, 4 queries, clips of 4 frames); returns the folder."""
    from transformers import InstructBlipVideoProcessor
    from transformers.models.instructblipvideo.video_processing_instructblipvideo import InstructBlipVideoVideoProcessor

    model, _ = T.instructblip_video()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower():
                continue
            fan_in = p[0].numel() if p.dim() >= 2 else 1
            p.copy_(torch.randn(p.shape, generator=g) * (fan_in**-0.5 if p.dim() >= 2 else 0.5))
    size = {"height": 28, "width": 28}
    vp = InstructBlipVideoVideoProcessor(size=size, crop_size=size, do_center_crop=False)
    tok = _tokenizer()
    proc = InstructBlipVideoProcessor(video_processor=vp, tokenizer=tok, qformer_tokenizer=_tokenizer(),
                                      num_query_tokens=model.config.num_query_tokens)  # fmt: skip
    model.config.video_token_index = tok.convert_tokens_to_ids("<video>")
    model.config.text_config.bos_token_id = tok.bos_token_id
    model.config.text_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder)
    proc.save_pretrained(folder)
    return Path(folder)


def random_video(path: Path, n: int, size: int = 32, seed: int = 0, fps: float = 25.0) -> Path:
    """An H.264 file of ``n`` random-block frames (``size`` px), written in chunks."""
    from video.synthetic import write_video

    rng = np.random.default_rng(seed)

    def chunks():
        for s in range(0, n, 256):
            small = rng.integers(0, 256, (min(256, n - s), 4, 4, 3), dtype=np.uint8)
            yield np.repeat(np.repeat(small, size // 4, axis=1), size // 4, axis=2)
    write_video(path, chunks(), fps=fps)
    return Path(path)


ROOT = Path(__file__).resolve().parents[1]
Q = "what colour is the square"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_instructblip_video(tmp_path_factory.mktemp("ibv") / "tiny-instructblip-video")


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("clips")
    random_video(d / "one_chunk.mp4", 4, seed=1)
    random_video(d / "long.mp4", 40, seed=2)
    return d


def _lm(folder, **cfg):
    from video import InfiniteVideo
    from video.hf import HFVideoConfig

    return InfiniteVideo.from_hf(folder, HFVideoConfig(**cfg), device="cpu", dtype="float32")


def _reference(folder, path, question):
    """The unmodified model on the decoded frames, through its own processor, get_video_features and generate."""
    import core.hf as H
    from video.io import VideoStream

    model, proc = H.load(folder, device="cpu", dtype="float32", attn="eager")
    frames = next(iter(VideoStream(path, chunk_size=4))).frames
    inputs = proc(images=[list(frames)], text=question, return_tensors="pt")
    with torch.no_grad():
        feats = model.get_video_features(inputs["pixel_values"], qformer_input_ids=inputs["qformer_input_ids"],
                                         qformer_attention_mask=inputs["qformer_attention_mask"]).pooler_output
        ids = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    return model, inputs, feats[0], ids[0, inputs["input_ids"].shape[1]:]


def test_alpha_one_equals_the_unmodified_model_bit_for_bit(tiny, clips):
    path = clips / "one_chunk.mp4"
    model, inputs, feats, ids = _reference(tiny, path, Q)
    lm = _lm(tiny, method="infinite", alpha=1.0, chunk_size=4)  # one clip of the model's own length
    res = lm.ingest(path, [Q])
    assert res.num_chunks == 1 and res.features.shape == (1, 16, 64)
    assert torch.equal(res.features[0], feats)
    assert torch.equal(lm.generate(res.features[0], Q, max_new_tokens=6), ids)
    assert lm.answer(path, Q, max_new_tokens=6) == lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
    # after reading with the memory the model is the unmodified one again: no hooks left, same outputs
    lm.config.alpha = 0.5
    assert not torch.equal(lm.ingest(path, [Q]).features[0], feats)
    assert all(not m._forward_hooks for m in lm.model.modules())
    lm.config.alpha = 1.0
    assert torch.equal(lm.ingest(path, [Q]).features[0], feats)
    with torch.no_grad():
        again = lm.model.get_video_features(inputs["pixel_values"], qformer_input_ids=inputs["qformer_input_ids"],
                                            qformer_attention_mask=inputs["qformer_attention_mask"]).pooler_output
    assert torch.equal(again[0], feats)


def test_the_memory_changes_the_output_when_alpha_is_below_one(tiny, clips):
    path = clips / "long.mp4"  # 10 chunks of 4 frames
    base = _lm(tiny, method="chunks", chunk_size=4).ingest(path, [Q, "how many"])
    assert base.num_chunks == 10 and base.coefficients is None
    mem = _lm(tiny, method="infinite", alpha=0.5, chunk_size=4).ingest(path, [Q, "how many"])
    nosticky = _lm(tiny, method="infinite_nosticky", alpha=0.5, chunk_size=4).ingest(path, [Q, "how many"])
    assert (mem.features - base.features).abs().max() > 1e-3
    assert (mem.features - nosticky.features).abs().max() > 1e-5  # sticky resampling changes what is kept
    # per layer, per question; one basis function per frame of a chunk (num_basis None = the chunk size)
    assert len(mem.coefficients) == 2 and mem.coefficients[0].shape == (2, 4, 32)
    assert torch.isfinite(mem.features).all()
    # alpha = 1 with the memory method is the chunk baseline exactly; "last" is the last chunk's read-out
    assert torch.equal(_lm(tiny, method="infinite", alpha=1.0, chunk_size=4).ingest(path, [Q]).features,
                       base.features[:1])
    last = _lm(tiny, method="chunks", aggregate="last", chunk_size=4).ingest(path, [Q]).features
    assert not torch.equal(last, base.features[:1])
    default = _lm(tiny, method="chunks").ingest(path, [Q])  # default chunks: 16 frames (the last padded)
    assert default.num_chunks == 3 and default.features.shape == (1, 64, 64)
    uni = _lm(tiny, method="uniform").ingest(path, [Q])
    assert uni.num_chunks == 1 and uni.frames_read == 4


def test_wrong_model_folders_and_bad_videos_get_clear_errors(tiny, clips, tmp_path):
    from video.hf import InfiniteVideoLM

    qwen, _ = T.qwen2(B=1, S=4)
    qwen.save_pretrained(tmp_path / "qwen")
    with pytest.raises(ValueError, match=r"'qwen2' model.*InstructBLIP-Video"):
        InfiniteVideoLM.from_hf(tmp_path / "qwen")
    with pytest.raises(ValueError, match="hub id"):
        InfiniteVideoLM.from_hf("Salesforce/instructblip-vicuna-7b")
    with pytest.raises(FileNotFoundError, match="config.json"):
        InfiniteVideoLM.from_hf(clips)
    lm = _lm(tiny)
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    for bad in ("empty.mp4", "corrupt.mp4"):
        with pytest.raises(ValueError, match=bad):
            lm.answer(tmp_path / bad, Q)
    with pytest.raises(FileNotFoundError, match="not found"):
        lm.answer(tmp_path / "absent.mp4", Q)
    with pytest.raises(ValueError, match="alpha"):
        _lm(tiny, alpha=1.5)


def test_a_bare_blip2_qformer_with_a_causal_lm(tmp_path):
    from transformers import Blip2QFormerConfig, Blip2QFormerModel

    from video.hf import InfiniteVideoLM

    torch.manual_seed(0)
    lm_model, _ = T.llama(B=1, S=4)
    qf = Blip2QFormerModel(Blip2QFormerConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                              intermediate_size=64, encoder_hidden_size=24,
                                              cross_attention_frequency=1)).eval()  # fmt: skip
    patch = torch.nn.Conv2d(3, 24, 7, stride=7)

    def vision(px):
        return patch(px).flatten(2).transpose(1, 2)  # (N, 16, 24)

    with torch.no_grad():
        for p in qf.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    pieces = dict(vision=vision, qformer=qf, query_tokens=torch.randn(1, 4, 32), projection=torch.nn.Linear(32, 64),
                  language_model=lm_model, tokenizer=_tokenizer(), image_size=28)  # fmt: skip
    path = random_video(tmp_path / "v.mp4", 12, seed=3)
    from video.hf import HFVideoConfig

    a = InfiniteVideoLM.from_pieces(**pieces, config=HFVideoConfig(method="chunks", chunk_size=4))
    b = InfiniteVideoLM.from_pieces(**pieces, config=HFVideoConfig(method="infinite", chunk_size=4, alpha=0.5))
    fa, fb = a.ingest(path, [Q]), b.ingest(path, [Q])
    assert fa.features.shape == (1, 16, 64) and fa.num_chunks == 3
    assert (fa.features - fb.features).abs().max() > 1e-4
    text = b.answer(path, Q, max_new_tokens=3)
    assert isinstance(text, str)
    with pytest.raises(ValueError, match="cross-attention"):
        InfiniteVideoLM.from_pieces(**{**pieces, "qformer": torch.nn.Linear(2, 2)})


def test_batch_cli_and_the_demo_accept_an_hf_model(tiny, clips, tmp_path):
    import csv

    from safetensors import safe_open

    from apps.infinite_video.ui import run_free_text
    from core.infra.cli import run_cli
    from video.batch import main, question_id

    vids = tmp_path / "videos"
    vids.mkdir()
    (vids / "long.mp4").write_bytes((clips / "long.mp4").read_bytes())
    (vids / "short.mp4").write_bytes((clips / "one_chunk.mp4").read_bytes())
    out = tmp_path / "out"
    argv = ["--model", f"hf:{tiny}", "--videos", str(vids), "--out", str(out), "--alpha", "0.5",
            "--max-new-tokens", "2", "--device", "cpu"]  # fmt: skip
    assert run_cli(main, [*argv, "--prompt", Q]) == 0
    with safe_open(str(out / f"long.mp4.{question_id(Q)}.safetensors"), "pt") as f:
        assert f.get_tensor("features").shape == (64, 64) and "layer1.coef" in f.keys()  # 16-frame chunks x 4 queries
        meta = f.metadata()
    assert meta["chunks"] == "3" and meta["question"] == Q and json.loads(meta["settings"])["reader"]["alpha"] == 0.5
    rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert [(r["video"], r["question"]) for r in rows] == [("long.mp4", Q), ("short.mp4", Q)]
    assert all(isinstance(r["answer"], str) for r in rows) and rows[0]["answer"] == meta["answer"]
    assert [r["video"] for r in csv.DictReader((out / "answers.csv").open())] == ["long.mp4", "short.mp4"]
    # a second prompt for the same folder adds its files (not refused); several questions per video from a file,
    # each video read once for all of them; the question asked before is skipped
    qfile = tmp_path / "questions.jsonl"
    qfile.write_text("\n".join(json.dumps(r) for r in [{"video": "long.mp4", "question": "how many"},
                                                       {"video": "long.mp4", "question": Q},
                                                       {"question": "a red blue green video"}]))  # fmt: skip
    assert run_cli(main, [*argv, "--questions", str(qfile)]) == 0
    rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert sorted((r["video"], r["question"]) for r in rows) == sorted(
        [("long.mp4", Q), ("long.mp4", "how many"), ("long.mp4", "a red blue green video"), ("short.mp4", Q),
         ("short.mp4", "a red blue green video")])  # fmt: skip
    manifest = {r["video"]: r for r in csv.DictReader((out / "manifest.csv").open())}
    assert manifest["long.mp4"]["questions"] == "2"  # one read of long.mp4 for its two new questions
    (tmp_path / "q.txt").write_text("what colour is the square\n")
    assert run_cli(main, [*argv, "--questions", str(tmp_path / "q.txt")]) == 0  # done before: nothing to do
    assert run_cli(main, [*argv[:-5], "0.25", "--device", "cpu", "--prompt", Q]) == 2  # other settings: refused
    assert run_cli(main, [*argv[:6], "--method", "moviechat"]) == 2
    # a transformers folder without hf: points to hf:DIR; a GPU asked for by name that is not there: one line, exit 2
    assert run_cli(main, ["--model", str(tiny), "--videos", str(vids), "--out", str(tmp_path / "o2")]) == 2
    if not torch.cuda.is_available():
        assert run_cli(main, [*argv[:6], "--device", "cuda"]) == 2
    text = run_free_text(None, str(clips / "long.mp4"), f"hf:{tiny}", Q, "infinite", 0.5, 2)
    assert "**A:**" in text and "3 chunk(s)" in text
    with pytest.raises(ValueError, match="hf:DIR"):
        run_free_text(None, str(clips / "long.mp4"), "", Q)


def test_cli_messages_for_a_folder_without_hf_and_a_missing_gpu(tiny, tmp_path):
    videos = tmp_path / "v"
    videos.mkdir()
    random_video(videos / "a.mp4", 4)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    run = lambda *a: subprocess.run([sys.executable, "-m", "video.batch", "--videos", str(videos), "--out",  # noqa: E731
                                     str(tmp_path / "o"), *a], capture_output=True, text=True, env=env, cwd=ROOT)
    done = run("--model", str(tiny))
    assert done.returncode == 2 and f"--model hf:{tiny}" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    done = run("--model", f"hf:{tiny}", "--device", "cuda")
    assert done.returncode == 2 and "no CUDA GPU" in done.stderr and "Traceback" not in done.stderr


def test_the_python_api_shows_progress_over_frames_and_can_hide_it(tiny, clips, capsys, monkeypatch):
    import tqdm as tqdm_module

    bars = []

    class Recorded(tqdm_module.tqdm):  # what the bar counted, whatever tqdm's redraw interval lets reach stderr
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.shown, self.what = not self.disable, k.get("unit")  # tqdm sets disable on close
            bars.append(self)

    monkeypatch.setattr(tqdm_module, "tqdm", Recorded)
    lm = _lm(tiny, method="chunks")
    lm.ingest(clips / "long.mp4", [Q])
    frame_bars = [b for b in bars if b.what == "frame"]
    assert len(frame_bars) == 1 and frame_bars[0].shown
    assert (frame_bars[0].n, frame_bars[0].total) == (40, 40)
    assert "frame" in capsys.readouterr().err
    bars.clear()
    lm.ingest(clips / "long.mp4", [Q], progress=False)
    assert [b.shown for b in bars if b.what == "frame"] == [False]
    assert "frame" not in capsys.readouterr().err


def test_a_short_last_chunk_is_padded_by_repeating_its_last_frame(tiny):
    """Reading a short last chunk equals reading it padded by hand with copies of its last frame (features, memory)."""
    rng = np.random.default_rng(5)
    frames = rng.integers(0, 256, (11, 32, 32, 3), dtype=np.uint8)
    idx = np.arange(11)
    pad = np.r_[np.arange(8, 11), np.full(5, 10)]
    lm = _lm(tiny, method="infinite", chunk_size=8, alpha=0.5)
    short = lm.read_chunks(iter([(frames[:8], idx[:8]), (frames[8:], idx[8:])]), 11, [Q])
    padded = lm.read_chunks(iter([(frames[:8], idx[:8]), (frames[pad], idx[pad])]), 11, [Q])
    assert short.frames_read == 11 and short.num_chunks == 2
    torch.testing.assert_close(short.features, padded.features, rtol=0, atol=0)
    for a, b in zip(short.coefficients, padded.coefficients, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_recipe_runs_end_to_end_on_the_tiny_model(tiny, clips, tmp_path):
    from core.infra.cli import run_cli
    from video.recipes.instructblip_video import is_right, main

    vids = tmp_path / "videos"
    vids.mkdir()
    for n in ("one_chunk.mp4", "long.mp4"):
        (vids / n).write_bytes((clips / n).read_bytes())
    qfile = tmp_path / "questions.json"
    qfile.write_text(json.dumps([{"video": "long.mp4", "question": Q, "answer": "red"},
                                 {"video": "one_chunk.mp4", "questions": [{"text": "how many", "answer": "two"}]},
                                 {"video": "absent.mp4", "question": "x", "answer": "y"}]))  # fmt: skip
    out = tmp_path / "run"
    argv = ["--model", str(tiny), "--videos", str(vids), "--questions", str(qfile), "--out", str(out), "--fps", "25",
            "--max-new-tokens", "2", "--device", "cpu"]  # fmt: skip
    assert run_cli(main, argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["methods"]) == {"uniform", "chunks", "infinite_nosticky", "infinite"}
    assert summary["questions"] == 2 and summary["majority"]["accuracy"] == 0.5
    rec = json.loads((out / "infinite" / "long.mp4.json").read_text())
    assert rec["chunks"] == 3 and len(rec["questions"]) == 1  # 40 frames in chunks of 16
    assert run_cli(main, [*argv, "--alpha", "0.5"]) == 2  # other settings: refused without --overwrite
    assert run_cli(main, [*argv[:2], "--videos", str(vids), "--questions", str(qfile), "--out", str(out),
                          "--methods", "moviechat"]) == 2  # fmt: skip
    assert is_right("Red, clearly.", "red") and not is_right("reddish", "red") and not is_right("", "red")


@pytest.mark.slow
def test_peak_memory_is_flat_from_1k_to_16k_frames(tiny, tmp_path):
    """One process reads 1K frames, then 16K frames of the same tiny size: the peak resident set may grow <= 10%, and
    and traced Python/numpy allocations grow by at most the frame index."""
    random_video(tmp_path / "v1k.mp4", 1024, seed=4)
    random_video(tmp_path / "v16k.mp4", 16384, seed=5)
    code = textwrap.dedent(f"""
        import resource, sys, json, torch, tracemalloc
        torch.set_num_threads(1)
        sys.path.insert(0, {str(ROOT)!r})
        from video.hf import InfiniteVideoLM, HFVideoConfig
        lm = InfiniteVideoLM.from_hf({str(tiny)!r}, config=HFVideoConfig(chunk_size=128, alpha=0.5), device="cpu",
                                     dtype="float32")
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = {{}}
        tracemalloc.start()
        for name in ("v1k", "v16k"):
            tracemalloc.reset_peak()
            r = lm.ingest({str(tmp_path)!r} + f"/{{name}}.mp4", ["what colour"])
            out[name] = [peak(), tracemalloc.get_traced_memory()[1], r.frames_read, r.peak_frames_held, r.num_chunks]
        print(json.dumps(out))
    """)  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    assert res["v1k"][2:] == [1024, 128, 8] and res["v16k"][2:] == [16384, 128, 128]
    assert res["v16k"][0] <= 1.10 * res["v1k"][0], res  # peak resident set of the process
    # Python and numpy allocations while reading (decoded frames are numpy arrays): one chunk of frames whatever the
    # length, plus the file's frame index (timestamps, selected indices: ~50 bytes a frame); a decoded 32x32 frame is
    # 3,072 bytes, so keeping frames (or anything per frame of that size) would break this bound
    assert res["v16k"][1] - res["v1k"][1] <= 64 * (16384 - 1024), res
