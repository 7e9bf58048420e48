"""The operators' service: JSON API over the SQL run log, dashboard pages, plotly figures.

`crossdc.dashboard.app.create_app(db_url)` builds the FastAPI app; `crossdc serve` runs it.
"""
