"""Images through tinyvllm, beside llama.cpp's mtmd on the same files in the same run (Phase 10).

    python benchmarks/bench_images.py                  # tinyvllm alone, on the HF checkpoint it makes
    python benchmarks/bench_images.py --peers DIR --save

The checkpoint is SmolVLM-256M-Instruct's shape with random weights (transformers' own initialization, seeded):
its SigLIP tower (768 wide, 12 layers, 512 px frames of 16 px patches, pixel shuffle by 4: 64 tokens a frame) and
SmolLM2-135M as the text model. Its processor keeps one 512 px frame per image (longest edge 512: no tiles), so an
image is 64 tokens in both engines. It is made once in --work-dir (needs the `oracle` extra: transformers, torch).
With --peers, llama.cpp's own converter (convert_hf_to_gguf.py, from the peers build's source tree) writes the text
GGUF (F32) and the mmproj (F16, its default) and both engines run those two files.

    encoder        one image's frame through the vision tower and connector, warm (median of --repeats)
    image prompt   a chat prompt with one image to its first token (median, distinct images: no cache hit)
    decode         tokens/s of --decode-tokens after that prompt
    batch          --batch text requests generating --decode-tokens each, alone and with --batch image requests
                   beside them (distinct images): generated tokens/s of the whole, and the ratio
    llama.cpp      llama-mtmd-cli on the same two files and images: its 'mtmd batch encoding done' of each image
                   after the first (the first pays its warm-up), 'image decoded' (the image tokens' prefill), and
                   llama_perf's decode rate; it serves one sequence, so the batch rows have no twin
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # (benchmarks/common.py)
from common import (BenchParser, add_peers_arg, code_version, find_peers, load_average, log, machine_description,
                    write_results)

VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=512,
              patch_size=16)
TEXT = dict(model_type="llama", vocab_size=49280, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
            max_position_embeddings=8192, tie_word_embeddings=True)
# SmolVLM's added tokens after SmolLM2's 49152, at SmolVLM's ids
IMAGE_TOKENS = ["<global-img>", *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
                "<fake_token_around_image>", "<image>", "<end_of_utterance>"]
QUESTION = "Describe this image in detail."


def make_checkpoint(out: Path, seed: int = 0) -> Path:
    """SmolVLM-256M's shape, random weights, SmolLM2's tokenizer with SmolVLM's image tokens."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from tinyvllm.convert import write_tokenizer
    from tinyvllm.model.gguf import GGUFFile
    from tinyvllm.model.weights import default_model_path

    log(f"making the random SmolVLM-256M-shaped checkpoint in {out}")
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, GGUFFile(default_model_path()).metadata, {49152 + i: t for i, t in enumerate(IMAGE_TOKENS)})
    config = Idefics3Config(text_config=TEXT, vision_config=VISION, scale_factor=4,
                            image_token_id=49152 + IMAGE_TOKENS.index("<image>"), tie_word_embeddings=True)
    torch.manual_seed(seed)
    Idefics3ForConditionalGeneration(config).eval().save_pretrained(out)
    Idefics3ImageProcessorPil(size={"longest_edge": 512}, max_image_size={"longest_edge": 512}).save_pretrained(out)
    return out


def gguf_pair(checkpoint: Path, llama_src: Path) -> tuple[Path, Path]:
    """llama.cpp's converter on the checkpoint: (text GGUF, mmproj GGUF)."""
    text, mmproj = checkpoint / "text.F32.gguf", checkpoint / "mmproj.F16.gguf"
    env = {**os.environ, "PYTHONPATH": str(llama_src / "gguf-py")}
    script = str(llama_src / "convert_hf_to_gguf.py")
    if not mmproj.is_file():
        subprocess.run([sys.executable, script, str(checkpoint), "--mmproj", "--outfile", str(mmproj)], env=env,
                       check=True, capture_output=True)
    if not text.is_file():  # its converter takes SmolVLM's text model under SmolVLM2's text architecture name
        with tempfile.TemporaryDirectory() as tmp:
            for path in checkpoint.iterdir():
                if path.suffix != ".gguf" and path.name != "config.json":
                    (Path(tmp) / path.name).symlink_to(path)
            config = json.loads((checkpoint / "config.json").read_text())
            (Path(tmp) / "config.json").write_text(json.dumps({**config, "architectures": ["VLlama3ForCausalLM"]}))
            subprocess.run([sys.executable, script, tmp, "--outtype", "f32", "--outfile", str(text)], env=env,
                           check=True, capture_output=True)
    return text, mmproj


def images(n: int, seed: int = 0) -> list:
    """n distinct 512 x 512 pictures: noise under a few filled ellipses."""
    import numpy as np
    from PIL import Image, ImageDraw

    out = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        image = Image.fromarray(rng.integers(0, 256, (512, 512, 3), dtype=np.uint8), "RGB")
        draw = ImageDraw.Draw(image)
        for _ in range(6):
            x, y = (int(v) for v in rng.integers(0, 400, 2))
            draw.ellipse([x, y, x + 120, y + 90], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        out.append(image)
    return out


def measure_tinyvllm(model: str, mmproj: str | None, args) -> dict:
    from tinyvllm.llm import LLM
    from tinyvllm.sampling_params import SamplingParams

    llm = LLM(model, mmproj=mmproj, max_model_len=1024, max_num_seqs=2 * args.batch)
    engine = llm.llm_engine
    tower = engine.model.vision_tower
    pictures = images(args.repeats + 2 * args.batch + 2)
    frames = tower.preprocess(pictures[0])
    tower.encode(frames)  # warm: compiled
    encoder_ms = []
    for picture in pictures[1:args.repeats + 1]:
        start = time.perf_counter()
        tower.encode(tower.preprocess(picture))
        encoder_ms.append((time.perf_counter() - start) * 1e3)

    def chat(picture, text=QUESTION):
        content = ([{"type": "image_pil", "image_pil": picture}] if picture is not None else []) + [
            {"type": "text", "text": text}]
        return llm._chat_prompt([{"role": "user", "content": content}], True, {})

    greedy = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    llm.generate(chat(pictures[0]), greedy, use_tqdm=False)  # warm: the graphs of a step with image rows
    first, decode = [], []
    for picture in pictures[args.repeats + 1:2 * args.repeats + 1] or pictures[-1:]:
        out = llm.generate(chat(picture), greedy, use_tqdm=False)[0]
        m = out.metrics
        first.append(m.first_token_time - m.arrival_time)
        decode.append((len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time))
    texts = [chat(None, f"Tell me a story about the number {i}.") for i in range(args.batch)]
    with_images = texts + [chat(p) for p in pictures[-args.batch:]]
    batch = {}
    for name, prompts in (("text_only", texts), ("with_images", with_images)):
        llm.generate(prompts, greedy, use_tqdm=False)  # warm (the images then hit the encoder cache: new ones next)
        prompts = prompts if name == "text_only" else texts + [chat(p) for p in images(args.batch, seed=1)]
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        batch[name] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    return {"image_tokens": tower.num_embeds(frames), "encoder_ms": statistics.median(encoder_ms),
            "encoder_ms_runs": encoder_ms, "image_prompt_first_token_s": statistics.median(first),
            "decode_tok_s": statistics.median(decode), "batch_tok_s": batch,
            "batch_with_images_over_text_only": batch["with_images"] / batch["text_only"]}


def measure_llama_cpp(llama, text: Path, mmproj: Path, args, work: Path) -> dict:
    paths = []
    for i, picture in enumerate(images(args.repeats + 1, seed=2)):
        paths.append(work / f"image-{i}.png")
        picture.save(paths[-1])
    cmd = [str(llama.bin_dir / "llama-mtmd-cli"), "-m", str(text), "--mmproj", str(mmproj), "-t", str(llama.threads),
           "--temp", "0", "-n", str(args.decode_tokens), "--ignore-eos", "-v",
           "-p", QUESTION + " <__media__>" * len(paths)]
    for path in paths:
        cmd += ["--image", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    log_text = r.stdout + r.stderr
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{log_text[-2000:]}")
    encoded = [int(ms) for ms in re.findall(r"mtmd batch encoding done in (\d+) ms", log_text)]
    decoded = [int(ms) for ms in re.findall(r"image decoded \(batch \d+/\d+\) in (\d+) ms", log_text)]
    decode = re.search(r"llama_perf_context_print:\s+eval time =.*?([\d.]+) tokens per second", log_text)
    # chunks alternate text and image: the image chunks' encodings are every other one, after the first (warm-up)
    image_ms = encoded[1::2][1:] if len(encoded) > 2 * len(paths) - 1 else encoded[1:]
    return {"encoder_ms": statistics.median(image_ms), "encoder_ms_runs": image_ms,
            "image_prefill_ms": statistics.median(decoded[1:] or decoded), "decode_tok_s": float(decode.group(1))}


def main(argv: list[str] | None = None) -> int:
    p = BenchParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="images timed per figure (default 3)")
    p.add_argument("--batch", type=int, default=4, help="text requests in the batch rows, and as many with images")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens each request generates (default 32)")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "tinyvllm" / "images"),
                   help="where the made checkpoint is kept (default ~/.cache/tinyvllm/images)")
    add_peers_arg(p)
    args = p.parse_args(argv)
    llama = find_peers(args)
    print(f"machine   {machine_description()}")
    checkpoint = make_checkpoint(Path(args.work_dir).expanduser() / "smolvlm-256m-random")
    run = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "code": code_version(), "load_average": [load_average()]}
    if llama is None:
        figures = {"files": "HF checkpoint", "tinyvllm": measure_tinyvllm(str(checkpoint), None, args)}
    else:
        text, mmproj = gguf_pair(checkpoint, llama.bin_dir.parent.parent)
        figures = {"files": f"{text.name} + {mmproj.name}", "tinyvllm": measure_tinyvllm(str(text), str(mmproj), args)}
        with tempfile.TemporaryDirectory() as work:
            figures["llama_cpp"] = measure_llama_cpp(llama, text, mmproj, args, Path(work))
        ours, theirs = figures["tinyvllm"], figures["llama_cpp"]
        figures["ratio"] = {"encoder": theirs["encoder_ms"] / ours["encoder_ms"],
                            "decode": ours["decode_tok_s"] / theirs["decode_tok_s"]}
    run["load_average"].append(load_average())
    figures["run"] = run
    ours = figures["tinyvllm"]
    print(f"files     {figures['files']} ({ours['image_tokens']} tokens an image)")
    print(f"encoder   tinyvllm {ours['encoder_ms']:.0f} ms an image"
          + (f" | llama.cpp {figures['llama_cpp']['encoder_ms']:.0f} ms ({figures['ratio']['encoder']:.2f}x)"
             if llama else ""))
    print(f"image prompt to first token {ours['image_prompt_first_token_s'] * 1e3:.0f} ms"
          + (f" | llama.cpp image tokens' prefill {figures['llama_cpp']['image_prefill_ms']:.0f} ms" if llama else ""))
    print(f"decode    tinyvllm {ours['decode_tok_s']:.1f} tok/s"
          + (f" | llama.cpp {figures['llama_cpp']['decode_tok_s']:.1f} ({figures['ratio']['decode']:.2f}x)"
             if llama else ""))
    b = ours["batch_tok_s"]
    print(f"batch     {args.batch} text requests {b['text_only']:.1f} tok/s; with {args.batch} image requests beside "
          f"them {b['with_images']:.1f} tok/s ({ours['batch_with_images_over_text_only']:.2f}x)")
    write_results("bench_images", figures, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
