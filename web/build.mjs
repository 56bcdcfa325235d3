// Builds the demo's two pages into copilot_runtime/demo_web/ (served by `copilot-runtime demo`):
//   /          src/index.html          react-core 1.74 (v2 chat, AG-UI)
//   /classic   src/classic/index.html  react-core + react-ui 1.10.6 (GraphQL)
// Both generations live in one node_modules: 1.74 under its own name, 1.10.6 under npm
// aliases (classic-react-core, classic-react-ui). Each page is a separate Vite build, so the
// classic build can point the real package names at the aliased 1.10.6 copies (one copy of
// each, shared by react-ui and the page), while 1.74's self-imports keep resolving to 1.74.
import { fileURLToPath } from "node:url";
import path from "node:path";
import { build } from "vite";

const here = path.dirname(fileURLToPath(import.meta.url));
const src = path.join(here, "src");
const outDir = process.env.DEMO_WEB_OUT ?? path.join(here, "..", "copilot_runtime", "demo_web");
const modules = path.join(here, "node_modules");
const classicNested = path.join(modules, "classic-react-core", "node_modules", "@copilotkit");

const common = {
  root: src,
  base: "/",
  configFile: false,
  logLevel: "warn",
  // React's automatic JSX runtime, so components need no `import React`.
  oxc: { jsx: { runtime: "automatic" } },
  build: {
    outDir, sourcemap: false, chunkSizeWarningLimit: 8192, reportCompressedSize: false,
    rollupOptions: {
      // The packages' "use client" directives mean nothing in a plain client bundle.
      onwarn: (warning, warn) => warning.code === "MODULE_LEVEL_DIRECTIVE" || warn(warning),
    },
  },
};

await build({
  ...common,
  build: { ...common.build, emptyOutDir: true, rollupOptions: { ...common.build.rollupOptions, input: path.join(src, "index.html") } },
});

await build({
  ...common,
  resolve: {
    alias: [
      { find: /^@copilotkit\/react-core(?=\/|$)/, replacement: "classic-react-core" },
      { find: /^@copilotkit\/react-ui(?=\/|$)/, replacement: "classic-react-ui" },
      { find: /^@copilotkit\/(shared|runtime-client-gql)(?=\/|$)/, replacement: `${classicNested}/$1` },
      // The page renders assistant markdown with react-ui's own react-markdown (remark-gfm's
      // version), not the older copy react-core's keep at the top of node_modules.
      { find: /^react-markdown$/, replacement: path.join(modules, "classic-react-ui", "node_modules", "react-markdown") },
    ],
  },
  build: {
    ...common.build,
    emptyOutDir: false,
    rollupOptions: { ...common.build.rollupOptions, input: path.join(src, "classic", "index.html") },
  },
});
console.log(`built the demo pages into ${outDir}`);
