"""The retrieval section: collections (documents topics), the indexing stage and the retrieve
stage. Read as ``MMSTREAM_RETRIEVAL_<NAME>``; see docs/retrieval.md for what each one trades."""

from __future__ import annotations

from schemas.settings_base import Section, setting


class RetrievalSettings(Section):
    max_k: int = setting(50, "Most hits one retrieve request may ask for (k).", ge=1, le=1000)
    default_k: int = setting(5, "Hits a retrieve request gets when it names no k; passages of a RAG generate.", ge=1)
    rag_max_k: int = setting(8, "Most passages a retrieval-augmented generate request may put into its prompt.", ge=1)
    overfetch: int = setting(
        4, "The ANN first pass fetches k times this, then rescoring against the stored vectors keeps the best k: "
        "higher is better recall for more work per search.", ge=1, le=64
    )
    ef_search: int = setting(128, "HNSW search breadth (ef): recall against search time.", ge=8)
    max_docs: int = setting(
        200_000, "Most documents one collection holds: a document past it is dead-lettered (payload_too_large).", ge=1
    )
    max_collections: int = setting(64, "Most collections one tenant may have indexed at once.", ge=1)
    max_doc_chars: int = setting(
        8_000, "Longest document text indexed (characters); longer ones are dead-lettered, never cut silently.", ge=1
    )
    max_doc_image_bytes: int = setting(
        4 * 1024 * 1024, "Largest image document, inline or by ref (a ref is read at most this far, and refused past "
        "it); the indexing stage holds at most index_image_batch of them at once.", ge=1024)
    index_image_batch: int = setting(8, "Image documents the indexing stage embeds in one engine call.", ge=1)
    max_meta_keys: int = setting(16, "Most metadata keys of one document (scalar values only).", ge=0)
    max_where_keys: int = setting(8, "Most keys of one retrieve request's metadata filter.", ge=0)
    reuse_threshold: float = setting(
        0.80, "Cosine at which a query is answered from a cached near-duplicate's candidate pool (rescored for it) "
        "instead of an index search (1.0: exact repeats only). Measured on a 100k-passage run's own stream with "
        "pools of 200: 0.80 avoided 52.5% of searches at recall@10 0.51 points lower, 0.85 50.1% at 0.08 "
        "(docs/retrieval.md).", gt=0.0, le=1.0
    )
    reuse_pool: int = setting(
        200, "Candidates each search keeps, rescored exactly, so that a near-duplicate query is answered by "
        "rescoring them for it (0: the cached hits as they are). Measured on a 100k-passage run's own stream, "
        "threshold 0.80: a pool of 200 avoided 52.5% of searches at recall@10 0.51 points lower, 100 at 1.59 lower; "
        "a pool above the graph's ef widens its walk (docs/retrieval.md).", ge=0
    )
    reuse_entries: int = setting(1024, "Cached query results per collection (each holds its query vector and candidate pool); 0 turns reuse off.",
                                 ge=0)
    snapshot_every_s: float = setting(
        30.0, "How often the retrieve stage snapshots an index that changed (0: never), so a restart reads the "
        "documents' vectors from the snapshot's position instead of from the start.", ge=0.0
    )
    retire_after_s: float = setting(
        3600.0, "After a model change, how long an index of a collection in a space no longer in use (another "
        "version of the model is ready and searched) is kept in memory with neither a search nor a change.", ge=0)
    index_batch: int = setting(32, "Documents the indexing stage embeds in one engine call.", ge=1)
    passage_chars: int = setting(
        1_200, "Longest text of one passage put into a RAG prompt (characters; longer passages are cut at a word).",
        ge=16
    )
