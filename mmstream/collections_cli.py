"""`mmstream collection add|put|delete|search`: a tenant's collections from the terminal.

``add`` creates the compacted documents topic (the operator's act: on a secured broker it
runs as the service principal, like `tenant add`, and the tenant may then write it);
``put``/``delete`` write documents (one by flags, or a JSON-lines file of ``{id, text,
meta}``); ``search`` sends a retrieve request and prints its events as JSON lines. The
tenant is the one of ``--properties`` (a file from `mmstream tenant add`), else ``default``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import mimetypes
import sys
from pathlib import Path
from typing import Any, Callable

from schemas.documents import IMAGE_MIMES
from schemas.request import COLLECTION_RE, TENANT_RE
from schemas.settings import Settings
from streams.connection import client_kwargs
from streams.topics import collection_spec, ensure_topics


def add_parser(cmd: Callable[..., argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    c = cmd("collection", help="a tenant's collections of documents for retrieval (and RAG generate)")
    sub = c.add_subparsers(dest="collection_command", required=True, metavar="ACTION")
    action = functools.partial(sub.add_parser, parents=[common])
    a = action("add", help="create a collection's documents topic (compacted, keyed by document id)")
    a.add_argument("name", metavar="NAME", help="the collection (a-z 0-9 _ -)")
    a.add_argument("--tenant", default="default", help="whose collection (default: %(default)s)")
    a.add_argument("--partitions", type=int, metavar="N", help="partitions (default: kafka.partitions)")
    p = action("put", help="add or replace documents")
    p.add_argument("name", metavar="NAME", help="the collection")
    p.add_argument("--id", help="the document's id (with --text)")
    p.add_argument("--text", help="the document's text (with --id); with --image, its caption")
    p.add_argument("--image", type=Path, metavar="FILE", help="an image document (JPEG, PNG or WebP; with --id): "
                   "found by image queries")
    p.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE", help="metadata (repeatable)")
    p.add_argument("--file", type=Path, metavar="JSONL", help="documents, one JSON map {id, text, meta} per line "
                   "({id, image: PATH, text: caption, meta} for an image, the path beside the file)")
    d = action("delete", help="remove a document")
    d.add_argument("name", metavar="NAME", help="the collection")
    d.add_argument("--id", required=True, help="the document's id")
    s = action("search", help="search a collection; prints the events as JSON lines")
    s.add_argument("name", metavar="NAME", help="the collection")
    s.add_argument("query", metavar="TEXT", help="what to search for")
    s.add_argument("-k", type=int, help="hits (default: retrieval.default_k)")
    s.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                   help="only documents whose metadata has this value (repeatable; the same key twice: either)")
    s.add_argument("--timeout", type=float, default=30.0, metavar="S", help="seconds to wait (default: %(default)s)")
    for sp in (p, d, s):
        sp.add_argument("--properties", type=Path, metavar="FILE",
                        help="act as the tenant of this client properties file (from `mmstream tenant add`)")


def run(args: argparse.Namespace, settings: Settings, client: Callable[..., Any], follow: Callable[..., Any],
        service_settings: Callable[[], Settings], user_error: type[Exception]) -> int:
    name = args.name
    if not COLLECTION_RE.fullmatch(name):
        raise user_error(f"{name!r} is not a collection name (1-63 of a-z 0-9 _ -, a letter or digit first)")
    if args.collection_command == "add":
        if not TENANT_RE.fullmatch(args.tenant):
            raise user_error(f"{args.tenant!r} is not a tenant name")
        s = service_settings()
        spec = collection_spec(s.kafka, args.tenant, name, args.partitions)
        made = asyncio.run(ensure_topics(s.kafka.bootstrap, [spec], s.kafka.replication_factor, client_kwargs(s)))
        print(f"{spec.name}: {'created' if made else 'exists already'}")
        return 0
    props = getattr(args, "properties", None)
    if args.collection_command == "put":
        docs = _documents(args, user_error)
        return asyncio.run(_put(client(settings, props), name, docs))
    if args.collection_command == "delete":
        return asyncio.run(_delete(client(settings, props), name, args.id))
    where = _pairs(args.where, user_error, many=True)
    return asyncio.run(_search(client(settings, props), name, args.query, args.k, where or None, args.timeout, follow))


def _documents(args: argparse.Namespace, user_error: type[Exception]) -> list[dict[str, Any]]:
    if args.file is not None:
        if args.id or args.text or args.image:
            raise user_error("give --file or --id/--text/--image, not both")
        docs = []
        for n, line in enumerate(args.file.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except ValueError:
                raise user_error(f"{args.file}:{n}: not JSON") from None
            if isinstance(d, dict) and isinstance(d.get("image"), str):  # a path, beside the file
                d = {**d, **_image(args.file.parent / d["image"], user_error, f"{args.file}:{n}: "),
                     "text": d.get("text") or ""}
            if not (isinstance(d, dict) and isinstance(d.get("id"), str) and isinstance(d.get("text"), str)):
                raise user_error(f"{args.file}:{n}: a document is a map with a string id and text (or image)")
            docs.append(d)
        return docs
    if args.image is not None:
        if not args.id:
            raise user_error("give --id with --image")
        return [{"id": args.id, **_image(args.image, user_error), "text": args.text or "",
                 "meta": _pairs(args.meta, user_error)}]
    if not (args.id and args.text):
        raise user_error("give --id and --text (or --image, or --file)")
    return [{"id": args.id, "text": args.text, "meta": _pairs(args.meta, user_error)}]


def _image(path: Path, user_error: type[Exception], where: str = "") -> dict[str, Any]:
    """An image document's bytes and mime, its type guessed from the name as `mmstream send`
    does; only the types a document may be (``schemas.documents.IMAGE_MIMES``)."""
    mime = mimetypes.guess_type(path.name)[0]
    if mime not in IMAGE_MIMES or not path.is_file():
        raise user_error(f"{where}image {str(path)!r} is not a file of {', '.join(sorted(IMAGE_MIMES))}")
    return {"image": path.read_bytes(), "mime": mime}


def _pairs(items: list[str], user_error: type[Exception], many: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise user_error(f"{item!r} is not KEY=VALUE")
        if many and key in out:
            out[key] = [*(out[key] if isinstance(out[key], list) else [out[key]]), value]
        else:
            out[key] = value
    return out


async def _put(client: Any, name: str, docs: list[dict[str, Any]]) -> int:
    async with client:
        for d in docs:
            if "image" in d:
                await client.put_image(name, d["id"], d["image"], d["mime"], d["text"], d.get("meta") or {})
            else:
                await client.put_document(name, d["id"], d["text"], d.get("meta") or {})
    print(f"{len(docs)} document(s) written to {client.collection_topic(name)}", file=sys.stderr)
    return 0


async def _delete(client: Any, name: str, doc_id: str) -> int:
    async with client:
        await client.delete_document(name, doc_id)
    return 0


async def _search(client: Any, name: str, query: str, k: int | None, where: dict[str, Any] | None,
                  timeout_s: float, follow: Callable[..., Any]) -> int:
    async with client:
        return await follow(await client.retrieve(name, query, k=k, where=where), timeout_s)
