from hypothesis import given
from hypothesis import strategies as st

from workers.breaker import CircuitBreaker
from workers.cache_keys import cache_key, content_digest

BASE = dict(modality="text", digest=content_digest(b"hello"), model="m", version="1", precision="fp32",
            preprocessing="p1", tenant="acme")


@given(field=st.sampled_from(["modality", "model", "version", "precision", "preprocessing", "tenant", "digest"]),
       other=st.text(alphabet="abcdefghij0123456789", min_size=1, max_size=8))
def test_key_changes_whenever_anything_that_changes_the_answer_changes(field, other):
    changed = {**BASE, field: other}
    if changed[field] == BASE[field]:
        return
    assert cache_key(**changed) != cache_key(**BASE)


def test_cross_tenant_sharing_is_opt_in():
    assert cache_key(**{**BASE, "tenant": None}) != cache_key(**BASE)
    assert cache_key(**{**BASE, "tenant": None}) == cache_key(**{**BASE, "tenant": None})


def test_breaker_opens_after_failures_and_tries_again_after_cooldown():
    b = CircuitBreaker(failures_to_open=2, cooldown_s=5, first_cooldown_s=5)
    assert b.allow(0)
    b.record(False, 0)
    assert b.allow(0)
    b.record(False, 1)
    assert not b.allow(2) and b.state == "open"
    assert b.allow(6)  # half-open trial
    b.record(False, 6)
    assert not b.allow(7)  # failed trial: open again
    b.record(True, 12)
    assert b.allow(12) and b.state == "closed"


def test_whole_result_key_names_the_models_and_needs_all_of_them():
    from workers.cache_keys import result_key

    parts = [("text", content_digest(b"a")), ("image", content_digest(b"b"))]
    models = {"text": "minilm/1/fp32/p1", "image": "effnet/1/fp32/p2"}
    key = result_key(tenant="t", task="embed", parts=parts, models=models)
    assert key is not None
    assert result_key(tenant="t", task="embed", parts=parts, models={**models, "image": "effnet/2/fp32/p2"}) != key
    assert result_key(tenant="u", task="embed", parts=parts, models=models) != key
    assert result_key(tenant="t", task="embed", parts=parts[::-1], models=models) != key
    assert result_key(tenant="t", task="embed", parts=parts, models={"text": "minilm/1/fp32/p1"}) is None
