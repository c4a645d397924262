"""The tokenizer cache folder is shared by every replica on a machine."""

from concurrent.futures import ThreadPoolExecutor

from api import tokenizer


def test_replicas_writing_the_same_cached_tokenizer_at_once_all_succeed(tmp_path):
    path = tmp_path / "cache" / "stub-model-0123456789abcdef.json"
    content = b'{"version": "1.0"}' * 20_000

    def write_many(_):
        for _ in range(40):
            tokenizer._write_file(path, content)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write_many, range(8)))
    assert path.read_bytes() == content
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    tokenizer._write_file(blocked / "stub-model.json", b"{}")
    assert blocked.read_text() == ""
