"""``GET /api/v1/catalog``: the protocol's catalogue of metrics and scalars, for the web view and other clients."""

from __future__ import annotations

from fastapi import APIRouter

from quantwatch.protocol import catalog_document
from quantwatch.service.api.deps import ReadAuth
from quantwatch.service.schemas import Catalog

router = APIRouter(prefix="/api/v1", tags=["catalog"])

_CATALOG = Catalog.model_validate(catalog_document())


@router.get("/catalog", response_model=Catalog, dependencies=[ReadAuth])
def catalog() -> Catalog:
    """Every per-layer metric and per-run scalar by name: scope, polarity, unit, Prometheus family, meaning, formula."""
    return _CATALOG
