"""The dashboard service: `streamlit run dashboard/app.py` (or `servelab dashboard`). Reads Postgres and Redis only.

Knows the pages and their URLs; the compare page is the front page, so a review is a link such as
/?baseline=<run ids>&candidates=<run ids>. Each page selects, reads through dashboard/reads.py and draws.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

PAGES = Path(__file__).resolve().parent / "pages"

st.set_page_config(page_title="servelab", page_icon=":material/compare_arrows:", layout="wide")
page = st.navigation([
    st.Page(PAGES / "compare.py", title="Compare", icon=":material/compare_arrows:", default=True),
    st.Page(PAGES / "runs.py", title="Runs", icon=":material/table_rows:", url_path="runs"),
    st.Page(PAGES / "sweep.py", title="Batch sweep", icon=":material/show_chart:", url_path="sweep"),
    st.Page(PAGES / "kv_cache.py", title="KV cache", icon=":material/memory:", url_path="kv-cache"),
    st.Page(PAGES / "jobs.py", title="Jobs and queues", icon=":material/queue:", url_path="jobs"),
])
page.run()
