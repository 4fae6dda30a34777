"""The engine side's small HTTP helpers, shared by the transports' routes on megarl's
embedded engine server (megarl.rollout.http): request bodies read like SGLang reads them,
answers shaped like SGLang's. Main entry points: `json_body`, `version_of`, `result`.
"""

from __future__ import annotations

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse


async def json_body(request: Request) -> dict:
    """The request's JSON object ({} for an empty body); 400 for anything else."""
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = await request.json()
    except ValueError as e:
        raise HTTPException(400, f"the body is not JSON: {e}")
    if not isinstance(body, dict):
        raise HTTPException(400, "the body must be a JSON object")
    return body


def version_of(body: dict) -> int:
    """The body's weight_version (SGLang sends a string; megarl's versions are step numbers)."""
    version = body.get("weight_version")
    if version is not None and not str(version).isdigit():
        raise HTTPException(400, f"weight_version {version!r}: megarl's versions are step numbers")
    return int(version or 0)


def result(success: bool, message: str) -> JSONResponse:
    """SGLang's answer to a weight route: {success, message}, 400 on failure."""
    return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)


def session_refusal(request: Request, route: str) -> JSONResponse | None:
    """SGLang's refusal of a weight route that needs a weight-update session when none is open
    (megarl.rollout.sglang_api.SESSION_REQUIRED_ROUTES); None when one is open."""
    if getattr(request.app.state, "weight_update_session", False):
        return None
    return result(False, f"{route.lstrip('/')} must run between begin_weight_update() and end_weight_update()")
