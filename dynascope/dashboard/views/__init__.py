"""Dashboard pages; each module exposes ``page()`` for ``st.navigation``."""
