// Swagger UI (vendored in static/swagger-ui/: the page works offline) on this server's /openapi.json. A script
// file rather than an inline one: the page's Content-Security-Policy allows scripts from this server only.
"use strict";
window.addEventListener("DOMContentLoaded", () => {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    validatorUrl: null, // never send the document to validator.swagger.io
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
  });
});
