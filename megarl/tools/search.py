"""The search tool (Search-R1): `<search> query </search>`, answered by the retrieval server
with the top documents inside `<information>`; and Search-R1's instruction prompt.

The tool holds a `Searcher` (megarl.retrieval.client.RetrievalClient, or anything with its
`search` method); the client's own deadline, retries and backoff bound every call, and a
search that still fails is the observation "Search failed: ...". Main entry point: `SearchTool`.
"""

from __future__ import annotations

from typing import Any, Protocol

from megarl.tools.base import Tool, ToolError, ToolSet, failure_text, tagged_observation

SEARCH_INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge needed, "
    "you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: {question}\n"
)


class Searcher(Protocol):
    async def search(self, queries: list[str], topk: int = 3) -> list: ...


class SearchTool(Tool):
    name = "search"
    description = "Search a knowledge base; returns the top documents for the query."
    purpose = "search"
    argument = "query"
    observation_tag = "information"
    timeout_s = None  # the client's deadline and retries bound each search

    def __init__(self, searcher: Searcher, topk: int = 3):
        self.searcher, self.topk = searcher, topk

    async def call(self, arguments: dict[str, Any]) -> str:
        from megarl.retrieval.documents import format_documents

        query = arguments.get(self.argument)
        if not isinstance(query, str) or not query.strip():
            raise ToolError(f"give the {self.argument} as a non-empty string")
        (result,) = await self.searcher.search([query.strip()], topk=self.topk)
        if result.error is not None:
            raise ToolError(result.error)
        return format_documents(result.docs).strip()


def format_observation(results) -> str:
    """The observation of one search result (a SearchResult), as the search tool returns it."""
    from megarl.retrieval.documents import format_documents

    body = failure_text(SearchTool.name, results.error) if results.error is not None else \
        format_documents(results.docs).strip()
    return tagged_observation(SearchTool.observation_tag, body)


def build_search_prompt(tokenizer, question: str) -> list[int]:
    """Prompt token ids for one question: the search instruction as the user's message,
    rendered with the tokenizer's chat template when it has one (instruct models), else
    as plain text (base models, as Search-R1 trains them)."""
    content = SEARCH_INSTRUCTION.format(question=question.strip())
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                 tokenize=False)
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(content, add_special_tokens=False)


SEARCH_TOOLS = ToolSet([SearchTool(searcher=None)])  # Search-R1's tool set: for parsing its actions and messages
INVALID_ACTION_MESSAGE = SEARCH_TOOLS.invalid_message()
