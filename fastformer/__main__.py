from fastformer.cli import main

raise SystemExit(main())
