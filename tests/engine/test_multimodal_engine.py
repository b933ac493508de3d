"""Images in, text out: prompts with images through the one engine, against HF's Idefics3 `generate` (Phase 10)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("transformers")
from vision_models import (IMAGE_TOKEN_ID, IMAGES, assert_greedy_equal_hf, assert_top20_equal_hf,  # noqa: E402
                           draw_image, hf_image_inputs, hf_model, hf_processor, image_request)

from tinyvllm.core.encoder_cache import EncoderCacheManager, MultiModalFeature  # noqa: E402
from tinyvllm.core.prefix_cache import block_hashes  # noqa: E402
from tinyvllm.engine.multimodal import MultiModalProcessor  # noqa: E402
from tinyvllm.llm import LLM  # noqa: E402
from tinyvllm.sampling_params import SamplingParams  # noqa: E402
from tinyvllm.worker.encoder_runner import EncoderRunner  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0)
PROMPTS = {
    "one image": ("<|im_start|>user\n<image>What is in this image?<|im_end|>\n", ["wide"]),
    "two images": ("Compare <image> with <image>: which one is brighter?", ["tall", "small"]),
    "text only": ("The capital of France is", []),
}


@pytest.fixture(scope="module")
def llm(idefics3_dir):
    return LLM(str(idefics3_dir), max_model_len=512, kv_cache_memory="8MiB", max_num_batched_tokens=64)


def request(name: str) -> dict | str:
    return image_request(*PROMPTS[name])


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_tokens_equal_hf(llm, idefics3_dir, name):
    (out,) = llm.generate(request(name), GREEDY, use_tqdm=False)
    assert_greedy_equal_hf(out, hf_model(idefics3_dir), hf_image_inputs(hf_processor(idefics3_dir), *PROMPTS[name]),
                           GREEDY.max_tokens)
    assert (out.prompt_token_ids.count(IMAGE_TOKEN_ID) > 0) == bool(PROMPTS[name][1])


@pytest.mark.parametrize("name", PROMPTS)
def test_top20_logprobs_equal_hf(llm, idefics3_dir, name):
    (out,) = llm.generate(request(name), SamplingParams(max_tokens=1, temperature=0, logprobs=20), use_tqdm=False)
    assert_top20_equal_hf(out, hf_model(idefics3_dir), hf_image_inputs(hf_processor(idefics3_dir), *PROMPTS[name]))


def test_images_on_the_discrete_gpus_path_give_the_cpu_paths_tokens(llm, idefics3_dir, monkeypatch):
    """The discrete GPU's path (tests/test_device_path.py) with images: staged inputs, the tower's and the steps'
    graphs replayed by tinygrad's TinyJit; prompts with 1 and 2 images, each split across prefill chunks."""
    from tinyvllm import platforms

    prompts = [request("one image"), request("two images"), request("text only")]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    monkeypatch.setattr(platforms, "DEVICE_PATH", "discrete")
    gpu = LLM(str(idefics3_dir), max_model_len=512, kv_cache_memory="8MiB", max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, GREEDY, use_tqdm=False)] == want
    small = {"prompt": "<image>", "multi_modal_data": {"image": IMAGES["small"]}}
    again = gpu.generate([request("two images"), small], GREEDY, use_tqdm=False)  # cached images and a new one
    assert again[0].outputs[0].token_ids == want[1]


def test_a_text_request_is_unchanged_beside_an_image_request(llm):
    (alone,) = llm.generate(request("text only"), GREEDY, use_tqdm=False)
    mixed = llm.generate([request("two images"), request("text only"), request("one image")], GREEDY, use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    (two,) = llm.generate(request("two images"), GREEDY, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == two.outputs[0].token_ids


def test_a_repeated_image_is_encoded_once(llm, idefics3_dir):
    image = draw_image(64, 48, seed=7)
    runs = llm.llm_engine.model_runner.encoder.num_encoder_runs
    hits = llm.llm_engine.scheduler.encoder_cache_manager.num_hits
    texts = ["Look: <image> What is it?", "A different start, then <image> again."]
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": image}} for t in texts], GREEDY, use_tqdm=False)
    assert llm.llm_engine.model_runner.encoder.num_encoder_runs == runs + 1
    assert llm.llm_engine.scheduler.encoder_cache_manager.num_hits > hits
    for text, out in zip(texts, outs):
        inputs = hf_processor(idefics3_dir)(text=text, images=[image], return_tensors="pt")
        assert_greedy_equal_hf(out, hf_model(idefics3_dir), inputs, GREEDY.max_tokens)


def test_the_engine_state_shows_the_encoder_cache(llm):
    from tinyvllm.engine.multimodal import image_hash

    engine, image = llm.llm_engine, draw_image(52, 36, seed=9)
    engine.add_request("looking", {"prompt": "See <image> now", "multi_modal_data": {"image": image}}, GREEDY)
    engine.step()  # the first chunk reaches the image: encoded, held for this request
    cache = engine.get_state()["encoder_cache"]
    (entry,) = [e for e in cache["entries"] if image_hash(image).startswith(e["mm_hash"])]
    assert entry["requests"] == ["looking"] and not entry["freeable"] and entry["num_embeds"] > 0
    assert cache["cache_size"] - cache["num_free_slots"] >= entry["num_embeds"]
    while engine.has_unfinished_requests():
        engine.step()
    (entry,) = [e for e in engine.get_state()["encoder_cache"]["entries"] if image_hash(image).startswith(e["mm_hash"])]
    assert entry["requests"] == [] and entry["freeable"]  # kept until its room is needed


def test_the_prefix_cache_shares_blocks_of_the_same_image_only(llm):
    text = "Describe this picture in detail, please: <image>"
    first, second = draw_image(40, 40, seed=11), draw_image(40, 40, seed=12)
    ask = [{"prompt": text, "multi_modal_data": {"image": im}} for im in (first, first, second)]
    outs = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in ask]
    offset = outs[0].prompt_token_ids.index(IMAGE_TOKEN_ID)
    bs = llm.llm_engine.config.cache_config.block_size
    assert outs[1].num_cached_tokens == (len(outs[1].prompt_token_ids) - 1) // bs * bs  # all its full blocks
    assert outs[2].num_cached_tokens == offset // bs * bs  # only the blocks before the image
    assert outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_block_hashes_name_the_image():
    def feature(mm_hash):
        return MultiModalFeature(mm_hash, offset=20, is_embed=np.ones(8, bool), data=np.zeros(1))
    ids = list(range(48))
    a, b = block_hashes(ids, 16, [], mm_features=[feature("a")]), block_hashes(ids, 16, [], mm_features=[feature("b")])
    assert a[0] == b[0] == block_hashes(ids, 16, [])[0]  # before the image: the tokens alone
    assert a[1] != b[1] and a[2] != b[2]  # from the block holding the image on: the image too (the chain)


def test_the_encoder_cache_evicts_unreferenced_outputs_oldest_first():
    def feature(mm_hash, n):
        return MultiModalFeature(mm_hash, 0, np.ones(n, bool), np.zeros(1))
    manager, x, y, z = EncoderCacheManager(10), feature("x", 6), feature("y", 4), feature("z", 5)
    manager.allocate("r1", x)
    manager.allocate("r2", y)
    assert not manager.can_allocate(z, budget=10)  # both still needed
    manager.free_encoder_input("r1", x)
    assert manager.can_allocate(z, budget=10) and not manager.can_allocate(z, budget=4)
    assert not manager.can_allocate(z, budget=10, pending=2)  # 6 evictable, 2 promised to the request's first image
    manager.allocate("r3", z)
    assert manager.get_freed_mm_hashes() == ["x"] and manager.check_and_update_cache("r4", y)
    assert not manager.check_and_update_cache("r4", x)
    queries, hits = manager.num_queries, manager.num_hits
    assert manager.check_and_update_cache("r4", y) and (manager.num_queries, manager.num_hits) == (queries, hits)


def test_a_miss_that_evicts_an_image_the_chunk_hits_later_ends_the_chunk_before_it():
    from tinyvllm.core.outputs import ModelRunnerOutput
    from tinyvllm.core.scheduler import Scheduler
    from tinyvllm.core.sequence import Sequence

    def feature(mm_hash, offset):
        return MultiModalFeature(mm_hash, offset, np.ones(8, bool), np.zeros(1))

    scheduler = Scheduler(num_blocks=32, block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
                          enable_prefix_caching=True, encoder_cache_size=12)
    scheduler.add_seq(Sequence("a", list(range(20)), SamplingParams(max_tokens=1), mm_features=[feature("x", 4)]))
    while scheduler.has_unfinished_seqs():  # x is cached, held by nobody: evictable
        scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput(sampled_token_ids={"a": [5]}))
    b = Sequence("b", list(range(40)), SamplingParams(max_tokens=2), mm_features=[feature("y", 2), feature("x", 20)])
    scheduler.add_seq(b)
    out = scheduler.schedule()  # y (8) fits only by evicting x (12 in all): the chunk ends before x
    assert out.num_scheduled_tokens["b"] == 20 and out.scheduled_encoder_inputs == {"b": [0]}
    assert out.free_encoder_mm_hashes == ["x"]
    scheduler.update_from_output(out, ModelRunnerOutput())
    out = scheduler.schedule()  # y computed past: its room takes x again
    assert out.scheduled_encoder_inputs == {"b": [1]} and out.free_encoder_mm_hashes == ["y"]


def test_an_image_chunked_across_steps_fills_the_right_rows():
    class Tower:
        def encode(self, pixels):
            return np.arange(6, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)

    class Seq:
        mm_features = [MultiModalFeature("h", 3, np.array([1, 1, 0, 1, 1, 1, 1], bool), np.zeros(1))]

    runner, embeds, mask = EncoderRunner(Tower()), np.zeros((8, 2), np.float32), np.zeros(8, np.int32)
    assert runner.gather([(Seq(), 0, 6, 2)], embeds, mask)  # positions 0..5 at rows 2..7: image positions 3, 4
    assert mask.tolist() == [0, 0, 0, 0, 0, 1, 1, 0] and embeds[5:7, 0].tolist() == [0, 1]
    assert runner.gather([(Seq(), 6, 4, 0)], embeds, mask)  # positions 6..9: 6, 7, 8, 9 are encoder rows 2..5
    assert mask.tolist() == [1, 1, 1, 1, 0, 0, 0, 0] and embeds[:4, 0].tolist() == [2, 3, 4, 5]
    assert runner.num_encoder_runs == 1


def test_bad_prompts_with_images_are_refused(llm, idefics3_dir):
    with pytest.raises(ValueError, match="2 <image> placeholder.*1 image"):
        llm.generate({"prompt": "<image> <image>", "multi_modal_data": {"image": IMAGES["wide"]}}, use_tqdm=False)
    with pytest.raises(ValueError, match="PIL.Image"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": b"png bytes"}}, use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data takes 'image'"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"video": IMAGES["wide"]}}, use_tqdm=False)
    tower = llm.llm_engine.model.vision_tower
    with pytest.raises(ValueError, match="does not fit the encoder cache"):
        MultiModalProcessor(llm.get_tokenizer(), tower, 8).process({"prompt": "<image>",
                                                                     "multi_modal_data": {"image": IMAGES["wide"]}})
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_config_whose_image_token_id_is_not_the_tokenizers_is_refused_at_start(llm, monkeypatch):
    tower = llm.llm_engine.model.vision_tower
    MultiModalProcessor(llm.get_tokenizer(), tower, 1024)  # the model's own: they agree
    monkeypatch.setattr(tower, "config", dataclasses.replace(tower.config, image_token_id=IMAGE_TOKEN_ID + 1))
    with pytest.raises(ValueError, match=rf"gives <image> the id {IMAGE_TOKEN_ID + 1}, but its tokenizer reads "
                                         rf"<image> as \[{IMAGE_TOKEN_ID}\]"):
        MultiModalProcessor(llm.get_tokenizer(), tower, 1024)


def test_a_text_model_refuses_images(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), max_model_len=128, kv_cache_memory="4MiB")
    with pytest.raises(ValueError, match="this model takes no images"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": IMAGES["wide"]}}, use_tqdm=False)
    assert llm.generate({"prompt": "Hello"}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def data_url(image, fmt: str = "PNG") -> str:
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def test_the_media_connector_reads_data_urls_and_local_files_under_the_allowed_path(tmp_path):
    from tinyvllm.engine.multimodal import MediaConnector, image_hash

    image = draw_image(40, 30, seed=5)
    connector = MediaConnector(allowed_local_media_path=str(tmp_path / "media"))
    assert image_hash(connector.fetch_image(data_url(image))) == image_hash(image)
    (tmp_path / "media").mkdir()
    image.save(tmp_path / "media" / "a.png")
    image.save(tmp_path / "b.png")
    assert image_hash(connector.fetch_image(f"file://{tmp_path}/media/a.png")) == image_hash(image)
    for url, error in [(f"file://{tmp_path}/b.png", "--allowed-local-media-path"),
                       (f"file://{tmp_path}/media/../b.png", "--allowed-local-media-path"),
                       ("https://example.com/a.png", "--allow-remote-media"),
                       ("ftp://example.com/a.png", "data:, http"),
                       ("data:text/plain;base64,aGk=", "data:image/<type>;base64"),
                       ("data:image/png;base64,not base64!", "base64 cannot be decoded"),
                       ("data:image/png;base64," + "iVBORw0KGgo" + "A" * 40, "cannot be decoded"),
                       (data_url(image, "TIFF"), "TIFF images are not supported")]:
        with pytest.raises(ValueError, match=error):
            connector.fetch_image(url)
    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        MediaConnector().fetch_image(f"file://{tmp_path}/media/a.png")


def test_an_oversized_image_is_refused(monkeypatch):
    from tinyvllm.engine import multimodal

    monkeypatch.setattr(multimodal, "MAX_IMAGE_PIXELS", 30 * 30)
    with pytest.raises(ValueError, match="40 x 30 pixels, more than"):
        multimodal.MediaConnector().fetch_image(data_url(draw_image(40, 30)))
    monkeypatch.setattr(multimodal, "MAX_IMAGE_BYTES", 100)
    with pytest.raises(ValueError, match="bytes allowed"):
        multimodal.MediaConnector().fetch_image(data_url(draw_image(40, 30)))


def test_expanded_token_ids_with_images_equal_the_text_prompt(llm):
    text, images = "Here: <image> and <image>.", [IMAGES["tall"], IMAGES["small"]]
    processor = llm.llm_engine.input_processor.multimodal
    ids = llm.get_tokenizer().encode(processor.expand(text, images))
    by_ids, by_text = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                                    {"prompt": text, "multi_modal_data": {"image": images}}], GREEDY, use_tqdm=False)
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids == ids
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    with pytest.raises(ValueError, match="image tokens where its images take"):
        llm.generate({"prompt_token_ids": ids[:-5], "multi_modal_data": {"image": images[:1]}}, use_tqdm=False)


def test_the_scheduler_stops_a_chunk_before_an_image_the_encoder_cache_has_no_room_for():
    from tinyvllm.core.outputs import ModelRunnerOutput
    from tinyvllm.core.scheduler import Scheduler
    from tinyvllm.core.sequence import Sequence

    def feature(mm_hash, offset):
        return MultiModalFeature(mm_hash, offset, np.ones(8, bool), np.zeros(1))

    scheduler = Scheduler(num_blocks=32, block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
                          enable_prefix_caching=True, encoder_cache_size=12)
    a = Sequence("a", list(range(40)), SamplingParams(max_tokens=2), mm_features=[feature("x", 4), feature("y", 20)])
    scheduler.add_seq(a)
    out = scheduler.schedule()  # room for x (8 of 12), not for y too: the chunk ends where y begins
    assert out.num_scheduled_tokens["a"] == 20 and out.scheduled_encoder_inputs == {"a": [0]}
    scheduler.update_from_output(out, ModelRunnerOutput())
    out = scheduler.schedule()  # x is computed past: its room is taken by y, x evicted for the runner to drop
    assert out.num_scheduled_tokens["a"] == 20 and out.scheduled_encoder_inputs == {"a": [1]}
    assert out.free_encoder_mm_hashes == ["x"]
    scheduler.update_from_output(out, ModelRunnerOutput())  # a's prompt is computed: y is held by nobody now
    b = Sequence("b", list(range(30)), SamplingParams(max_tokens=2), mm_features=[feature("y", 10)])
    scheduler.add_seq(b)
    hits = scheduler.encoder_cache_manager.num_hits
    out = scheduler.schedule()
    assert "b" in out.num_scheduled_tokens and "b" not in out.scheduled_encoder_inputs  # y is still cached: a hit
    assert scheduler.encoder_cache_manager.num_hits == hits + 1
