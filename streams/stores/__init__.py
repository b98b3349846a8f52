"""What the pipeline keeps in Redis beside the engines' own reuse cache: the encoders' load
reports and model identities (``load_reports``), the whole-result cache (``result_cache``)
and the claim-check sweep (``claim_sweep``). Each failure here costs only time: a caller
keeps its last numbers, or goes on without the cache.
"""
