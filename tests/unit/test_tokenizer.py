from hypothesis import given
from hypothesis import strategies as st

from kvfleet_sim.tokenizer import Tokenizer

TOK = Tokenizer(128_256)


@given(st.text(min_size=1, max_size=300), st.text(max_size=100))
def test_shared_text_prefix_gives_shared_token_prefix(prefix: str, rest: str) -> None:
    a, b = TOK.encode(prefix), TOK.encode(prefix + rest)
    assert b[: len(a) - 1] == a[:-1]  # all but the possibly-cut last piece


def test_about_four_characters_per_token() -> None:
    text = (
        "Large language model serving systems batch requests continuously and reuse the "
        "key-value cache of shared prompt prefixes across requests. "
    ) * 20
    assert 3.2 < len(text) / TOK.count(text) < 4.8


def test_generation_is_deterministic_and_retokenises_to_itself() -> None:
    ids = TOK.generate_ids(42, 200)
    assert ids == TOK.generate_ids(42, 200) != TOK.generate_ids(43, 200)
    assert TOK.encode(TOK.decode(ids)) == ids
    assert ids[:50] == [next(g) for g in [TOK.generate(42)] for _ in range(50)]
