import { Parser } from '@asyncapi/parser';
import fs from 'fs';
const parser = new Parser();
const text = fs.readFileSync(process.argv[2], 'utf8');
const { document, diagnostics } = await parser.parse(text);
const errors = diagnostics.filter(d => d.severity === 0);
for (const d of diagnostics) console.log(JSON.stringify({severity: d.severity, code: d.code, message: d.message, path: d.path.join('/')}));
if (!document || errors.length) { console.error(`INVALID: ${errors.length} errors`); process.exit(1); }
console.log(`VALID: ${document.channels().length} channels, ${document.operations().length} operations, ${document.messages().length} messages`);
