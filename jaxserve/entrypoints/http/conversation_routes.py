"""OpenAI's Conversations API: POST /v1/conversations, GET / POST (metadata) / DELETE
/v1/conversations/{id}, GET / POST /v1/conversations/{id}/items, GET / DELETE
/v1/conversations/{id}/items/{item_id}. The store (agents/conversations.py) lives in the server's
data directory beside the stored responses, opened on first use; a conversation is its tenant's
(another tenant's: 404). POST /v1/responses with `conversation` reads and extends one
(entrypoints/serving/response_runs.py)."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from jaxserve.agents.conversations import ConversationStore
from jaxserve.entrypoints.http.app_state import STATE_KEY
from jaxserve.entrypoints.http.front_door import caller
from jaxserve.entrypoints.http.json_body import read_json
from jaxserve.entrypoints.http.openapi import Route
from jaxserve.entrypoints.serving import response_models as out
from jaxserve.entrypoints.serving.request_models import (ConversationCreate,
                                                         ConversationItemsAdd,
                                                         ConversationUpdate)
from jaxserve.entrypoints.serving.responses import as_items
from jaxserve.entrypoints.serving.validation import validate
from jaxserve.errors import InvalidRequest

MAX_LIST = 100  # items per page


class Conversations:
    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self._store: ConversationStore | None = None

    @property
    def store(self) -> ConversationStore:
        if self._store is None:
            self._store = ConversationStore(self.data_dir)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


CONVERSATIONS_KEY = web.AppKey("conversations", Conversations)


def _store(request: web.Request) -> ConversationStore:
    request.app[STATE_KEY].require_serving()  # 503 while warming up, as /v1/responses
    return request.app[CONVERSATIONS_KEY].store


def _ids(request: web.Request) -> tuple[str, str]:
    return caller(request).tenant.name, request.match_info["conversation_id"]


def _items(body) -> list[dict]:
    return as_items([item.model_dump(exclude_none=True) for item in body.items or ()])


def _list(items: list[dict], has_more: bool) -> web.Response:
    return web.json_response({"object": "list", "data": items,
                              "first_id": items[0]["id"] if items else None,
                              "last_id": items[-1]["id"] if items else None,
                              "has_more": has_more})


async def create(request: web.Request) -> web.Response:
    store = _store(request)
    body = validate(ConversationCreate, await read_json(request))
    return web.json_response(store.create(caller(request).tenant.name, body.metadata or {},
                                          _items(body)))


async def retrieve(request: web.Request) -> web.Response:
    return web.json_response(_store(request).get(*_ids(request)))


async def update(request: web.Request) -> web.Response:
    store = _store(request)
    body = validate(ConversationUpdate, await read_json(request))
    return web.json_response(store.update(*_ids(request), body.metadata))


async def delete(request: web.Request) -> web.Response:
    tenant, cid = _ids(request)
    _store(request).delete(tenant, cid)
    return web.json_response({"id": cid, "object": "conversation.deleted", "deleted": True})


async def list_items(request: web.Request) -> web.Response:
    unknown = sorted(set(request.query) - {"limit", "order", "after", "include"})
    if unknown:
        raise InvalidRequest(f"unknown query parameter {unknown[0]!r}", param=unknown[0])
    text = request.query.get("limit", "20")
    limit = int(text) if text.isdigit() else 0
    if not 1 <= limit <= MAX_LIST:
        raise InvalidRequest(f"'limit' must be an integer in [1, {MAX_LIST}]", param="limit")
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be asc or desc", param="order")
    page = _store(request).page(*_ids(request), limit, order, request.query.get("after"))
    return _list(page.items, page.has_more)


async def add_items(request: web.Request) -> web.Response:
    store = _store(request)
    body = validate(ConversationItemsAdd, await read_json(request))
    items = _items(body)
    store.add(*_ids(request), items)
    return _list(items, False)


async def get_item(request: web.Request) -> web.Response:
    return web.json_response(_store(request).item(*_ids(request),
                                                  request.match_info["item_id"]))


async def delete_item(request: web.Request) -> web.Response:
    store = _store(request)
    store.delete_item(*_ids(request), request.match_info["item_id"])
    return web.json_response(store.get(*_ids(request)))


def routes() -> list[Route]:
    one = "/v1/conversations/{conversation_id}"
    errors = (400, 401, 404, 429, 503)
    return [
        Route("POST", "/v1/conversations", create, "Create a conversation (OpenAI "
              "Conversations API), with up to 20 items", ConversationCreate, out.Conversation,
              errors=errors, tags=("openai",)),
        Route("GET", one, retrieve, "A conversation", ok=out.Conversation, errors=errors,
              tags=("openai",)),
        Route("POST", one, update, "Replace a conversation's metadata", ConversationUpdate,
              out.Conversation, errors=errors, tags=("openai",)),
        Route("DELETE", one, delete, "Delete a conversation and its items",
              ok=out.ConversationDeleted, errors=errors, tags=("openai",)),
        Route("GET", one + "/items", list_items, "A conversation's items, a page of them",
              ok=out.ItemList, errors=errors, tags=("openai",)),
        Route("POST", one + "/items", add_items, "Add up to 20 items to a conversation",
              ConversationItemsAdd, out.ItemList, errors=errors, tags=("openai",)),
        Route("GET", one + "/items/{item_id}", get_item, "One item of a conversation",
              ok=out.ConversationItem, errors=errors, tags=("openai",)),
        Route("DELETE", one + "/items/{item_id}", delete_item, "Delete an item; the "
              "conversation", ok=out.Conversation, errors=errors, tags=("openai",)),
    ]
