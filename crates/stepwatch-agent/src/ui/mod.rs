//! The web page at `/`: the node's GPUs, a job's ranks and a rank's step
//! anatomy, drawn in the browser from `/api/v1`. Plain HTML, CSS and
//! JavaScript with hand-drawn SVG, embedded in the binary: no CDN, no
//! build step, nothing to install beside the agent.

use std::sync::Arc;

use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::state::AgentState;

/// The page; its script and style are the two assets below.
const INDEX_HTML: &str = include_str!("index.html");
const APP_JS: &str = include_str!("app.js");
const STYLE_CSS: &str = include_str!("style.css");

/// `/`, `/ui/app.js` and `/ui/style.css`. `no-cache`: a browser asks again
/// after an agent upgrade (the assets are a few kilobytes; the data the page
/// polls is what costs).
pub fn routes() -> Router<Arc<AgentState>> {
    Router::new()
        .route(
            "/",
            get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }),
        )
        .route(
            "/ui/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/ui/style.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE_CSS) }),
        )
}

fn asset(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
}
