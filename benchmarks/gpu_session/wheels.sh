# On the development machine, in the repository root, once a session: the wheels that the GPU
# machine lacks (gguf, the server's and the tests' packages), for its Python 3.12, into .whl/
# (ignored by git through .git/info/exclude). Each call then names ".whl" in `carry`.
set -e
mkdir -p .git/info && (grep -qx '.whl/' .git/info/exclude 2>/dev/null || echo '.whl/' >> .git/info/exclude)
python3 -m pip install -q gguf fastapi uvicorn openai  # (their versions decide the wheels' versions)
for p in gguf fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection openai jiter \
         sniffio annotated-doc opentelemetry-api httpx2 httpcore2 truststore anyio h11; do
  v=$(python3 -m pip show $p | sed -n 's/^Version: //p')
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$p==$v"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any -d .whl distro
ls .whl | wc -l; du -sh .whl
